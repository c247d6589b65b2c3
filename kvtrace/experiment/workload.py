"""A deterministic agentic workload: episodes of tool-using turns generated from a seed.

Each turn the model's completion is parsed for a tool call (``CALL tool(argument)``); the
simulated environment answers with an observation, or with an error message when the completion
holds no valid call. Observations depend only on the completion text and the episode's own state,
so two runs that produce the same completions see the same observations, and a fork in one turn
carries into every later prompt — as in a real agent.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

SYSTEM = ("You are an agent with tools. Call one per turn as CALL tool(argument). "
          "Tools: calc(expression), lookup(key), ls(dir), cat(path).\n")

_WORDS = ("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "lambda", "theta", "zeta")
_CALL = re.compile(r"CALL\s+(calc|lookup|ls|cat)\(([^()]{0,40})\)")
_ARITHMETIC = re.compile(r"^\s*(-?\d{1,6})\s*([-+*])\s*(-?\d{1,6})\s*$")


@dataclass
class Episode:
    """One episode's task and its private environment (a tiny key/value store and file system)."""

    index: int
    task: str
    facts: dict[str, str]
    files: dict[str, str]
    calls: int = field(default=0)

    @property
    def episode_id(self) -> str:
        return f"e{self.index:03d}"

    def opening(self) -> str:
        return f"{SYSTEM}Task {self.index}: {self.task}\nAgent:"

    def observe(self, completion: str, turn: int) -> str:
        """The environment's reply to one completion (deterministic in the completion text)."""
        match = _CALL.search(completion)
        if not match:
            return f"\nObservation {turn}: error: no tool call found; use CALL tool(argument).\nAgent:"
        self.calls += 1
        tool, argument = match.group(1), match.group(2).strip()
        return f"\nObservation {turn}: {tool} -> {self._run(tool, argument)}\nAgent:"

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
        return self.files.get(argument, f"error: no file {argument!r}")


def make_episodes(n: int, seed: int) -> list[Episode]:
    """``n`` episodes from ``seed``; the same seed always gives the same tasks and environments."""
    episodes = []
    for i in range(n):
        rng = random.Random(f"{seed}:{i}")
        words = rng.sample(_WORDS, 4)
        facts = {w: str(rng.randint(1, 999)) for w in words}
        files = {f"/{words[0]}/{w}.txt": f"{w} = {facts[w]}" for w in words[1:]}
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        task = rng.choice((
            f"find the value of {words[1]} and add {a}.",
            f"read the files in /{words[0]} and multiply {words[2]} by {b}.",
            f"compute {a} * {b}, then look up {words[3]}.",
        ))
        episodes.append(Episode(i, task, facts, files))
    return episodes


def episode_order(n: int, order: str, seed: int) -> list[int]:
    """Episode indices in the order a run serves them: canonical, or a seeded shuffle."""
    indices = list(range(n))
    if order == "shuffled":
        random.Random(f"{seed}:order").shuffle(indices)
    elif order != "canonical":
        raise ValueError(f"unknown order {order!r}")
    return indices
