"""A deterministic agentic workload: episodes of tool-using turns generated from a seed.

Each turn the model's completion is parsed for a tool call (``CALL tool(argument)``) and the
simulated environment answers with an observation. A model that emits no valid call (a random-weight
model never does) still gets an answer: the environment reads the completion as a free-form command
and runs the tool it resolves to, so every turn adds an observation whose length and content depend
on the episode and on what the model wrote — prompts grow like a real agent's, not by one fixed error
message. Observations depend only on the episode's own state, the turn and the completion text (a
content hash, never Python's per-process ``hash``), so two runs that produce the same completions see
the same observations, and a fork in one turn carries into every later prompt — as in a real agent.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass, field

SYSTEM = ("You are an agent with tools. Call one per turn as CALL tool(argument). "
          "Tools: calc(expression), lookup(key), ls(dir), cat(path), grep(pattern).\n")

_WORDS = ("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "lambda", "theta", "zeta")
_LEVELS = ("INFO", "WARN", "ERROR", "DEBUG")
_EVENTS = ("started", "finished", "retrying", "timed out", "cache miss", "cache hit", "connected", "closed")
_CALL = re.compile(r"CALL\s+(calc|lookup|ls|cat|grep)\(([^()]{0,40})\)")
_ARITHMETIC = re.compile(r"^\s*(-?\d{1,6})\s*([-+*])\s*(-?\d{1,6})\s*$")
_TOOLS = ("calc", "lookup", "ls", "cat", "grep")


def _content_seed(*parts: object) -> int:
    """A seed from content, stable across processes and Python versions."""
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "big")


@dataclass
class Episode:
    """One episode's task and its private environment (a key/value store, files and logs)."""

    index: int
    seed: int
    task: str
    facts: dict[str, str]
    files: dict[str, str]
    calls: int = field(default=0)
    """Valid tool calls the model made (the rest were resolved from free text)."""

    @property
    def episode_id(self) -> str:
        return f"e{self.index:03d}"

    def opening(self) -> str:
        return f"{SYSTEM}Task {self.index}: {self.task}\nAgent:"

    def observe(self, completion: str, turn: int) -> str:
        """The environment's reply to one completion (deterministic in episode, turn and completion)."""
        match = _CALL.search(completion)
        if match:
            self.calls += 1
            tool, argument = match.group(1), match.group(2).strip()
            note = ""
        else:
            tool, argument = self._resolve(completion, turn)
            note = "no CALL found; ran "
        return f"\nObservation {turn}: {note}{tool}({argument}) -> {self._run(tool, argument)}\nAgent:"

    def _resolve(self, completion: str, turn: int) -> tuple[str, str]:
        """The command a free-form completion resolves to: a tool and an argument from this episode."""
        rng = random.Random(_content_seed(self.seed, self.index, turn, completion))
        tool = rng.choice(_TOOLS)
        if tool == "calc":
            return tool, f"{rng.randint(2, 999)} {rng.choice('+-*')} {rng.randint(2, 999)}"
        if tool == "lookup":
            return tool, rng.choice(sorted(self.facts) + ["unknown"])
        if tool == "ls":
            return tool, rng.choice(sorted({p.rsplit("/", 1)[0] for p in self.files}))
        if tool == "grep":
            return tool, rng.choice(_LEVELS + _WORDS[:3])
        return tool, rng.choice(sorted(self.files))

    def _run(self, tool: str, argument: str) -> str:
        if tool == "calc":
            m = _ARITHMETIC.match(argument)
            if not m:
                return "error: calc takes a op b"
            a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
            return str(a + b if op == "+" else a - b if op == "-" else a * b)
        if tool == "lookup":
            return self.facts.get(argument, f"error: unknown key {argument!r}")
        if tool == "ls":
            names = sorted(p for p in self.files if p.startswith(argument.rstrip("/") + "/"))
            return " ".join(names) if names else f"error: no directory {argument!r}"
        if tool == "grep":
            hits = [f"{path}: {line}" for path, text in sorted(self.files.items()) for line in text.split("\n")
                    if argument and argument in line]
            return "\n".join(hits[:12]) if hits else f"no match for {argument!r}"
        return self.files.get(argument, f"error: no file {argument!r}")


def _log(rng: random.Random, words: list[str]) -> str:
    """A log file of 2 to 14 lines: the long, varied observations real tools return."""
    lines = []
    for _ in range(rng.randint(2, 14)):
        lines.append(f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d} {rng.choice(_LEVELS)} "
                     f"{rng.choice(words)} {rng.choice(_EVENTS)} after {rng.randint(1, 999)} ms")
    return "\n".join(lines)


def make_episodes(n: int, seed: int) -> list[Episode]:
    """``n`` episodes from ``seed``; the same seed always gives the same tasks and environments."""
    episodes = []
    for i in range(n):
        rng = random.Random(f"{seed}:{i}")
        words = rng.sample(_WORDS, 4)
        facts = {w: str(rng.randint(1, 999)) for w in words}
        files = {f"/{words[0]}/{w}.txt": f"{w} = {facts[w]}" for w in words[1:]}
        files.update({f"/var/log/{w}.log": _log(rng, words) for w in words[:rng.randint(1, 3)]})
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        task = rng.choice((
            f"find the value of {words[1]} and add {a}.",
            f"read the files in /{words[0]} and multiply {words[2]} by {b}.",
            f"compute {a} * {b}, then look up {words[3]}.",
            f"find out why {words[0]} timed out in the logs, then report {words[1]}.",
        ))
        episodes.append(Episode(i, seed, task, facts, files))
    return episodes


def episode_order(n: int, order: str, seed: int) -> list[int]:
    """Episode indices in the order a run serves them: canonical, or a seeded shuffle."""
    indices = list(range(n))
    if order == "shuffled":
        random.Random(f"{seed}:order").shuffle(indices)
    elif order != "canonical":
        raise ValueError(f"unknown order {order!r}")
    return indices
