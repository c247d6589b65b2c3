"""The llama-server backend: a replay's steps sent to a running llama-server, on one slot.

Each step is the recorded prompt as token ids on ``/completion``, greedy, ``n_predict`` its recorded
length. Recompute is ``cache_prompt: false`` (the slot's state is dropped and the prompt computed
afresh); a step that starts from a request's end state runs with ``cache_prompt: true`` once the
slot holds that state, which is rebuilt by re-running the request (and the ones it started from)
first whenever the slot holds another. A prompt-cache restore is replayed the same way: the state
the restore put back is the end state of the request that stored it. The reused count is the
server's own (``timings.cache_n``), as the proxy recorded it.

The server cannot say which state a reuse came from: it must keep none but the slot's own
(``--cache-ram 0``, docs/postmortem.md), or a state saved from another replay could be restored.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from kvtrace import http_client
from kvtrace.errors import EngineFailed
from kvtrace.progress import Progress
from kvtrace.replay.recorded import EngineConfiguration, ReplayRefused, Step

SLOT = 0
"""The slot every step runs on: states are rebuilt there, so one is enough."""


class ServerBackend:
    def __init__(self, url: str, timeout: float):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._sent = 0

    def execute(self, configuration: EngineConfiguration, steps: list[Step],
                progress: Progress) -> dict[str, dict[str, Any]]:
        self._check_serves(configuration)
        self._post(f"/slots/{SLOT}?action=erase", {}, optional=True)  # a fresh start, where the server allows it
        by_span = {s.span_id: s for s in steps if s.key == s.span_id}
        holding: Optional[str] = None  # the key of the step whose end state the slot holds

        def run(step: Step) -> dict[str, Any]:
            nonlocal holding
            if step.starts_from is not None and holding != step.starts_from:
                run(by_span[step.starts_from])  # rebuild the state this step starts from
            outcome = self._complete(step)
            holding = step.key
            return outcome

        progress.start(len(steps), "requests")
        outcomes = {}
        try:
            for done, step in enumerate(steps):
                progress(f"request {done + 1}/{len(steps)}")
                outcomes[step.key] = run(step)
                progress.advance(1)
        finally:
            progress.close()
        return outcomes

    def _complete(self, step: Step) -> dict[str, Any]:
        body = {"prompt": list(step.prompt), "n_predict": max(1, step.max_tokens), "temperature": 0.0,
                "cache_prompt": step.starts_from is not None, "id_slot": SLOT, "return_tokens": True,
                "n_probs": 1, "stream": False}
        answer = self._post("/completion", body)
        ids = answer.get("tokens") or [p["id"] for p in answer.get("completion_probabilities") or []]
        timings = answer.get("timings") or {}
        return {"token_ids": [int(t) for t in ids], "reused": int(timings.get("cache_n") or 0)}

    def _check_serves(self, recorded: EngineConfiguration) -> None:
        """Refuse a server other than the recorded one: another model (by name, all the record holds) or build."""
        from kvtrace.proxy.upstream_profile import profile_of_props

        props = self._get("/props")
        profile = profile_of_props(props)
        if profile is None:
            raise ReplayRefused(f"the server at {self.url} is not llama-server (its /props says otherwise); the run "
                                f"was recorded in front of llama-server")
        served = {props.get("model_path"), props.get("model_alias")}
        try:
            served |= {m.get("id") for m in self._get("/v1/models").get("data") or []}
        except (EngineFailed, AttributeError):
            pass  # /props named it already
        names = {os.path.basename(str(n)) for n in served if n}
        wanted = {os.path.basename(str(n)) for n in (recorded.model_fingerprint, recorded.model) if n}
        differences = []
        if not names & wanted:
            differences.append(f"model ({', '.join(sorted(wanted)) or 'unnamed'} vs {', '.join(sorted(names))})")
        if recorded.engine_version and profile.version != recorded.engine_version:
            differences.append(f"build ({recorded.engine_version} vs {profile.version})")
        if differences:
            raise ReplayRefused(f"the llama-server at {self.url} differs from the recorded one in "
                                f"{'; '.join(differences)} (recorded vs here); replay needs the same model and build")

    def _get(self, path: str) -> Any:
        return self._json(path, lambda: http_client.request("GET", self.url + path, timeout_s=self.timeout))

    def _post(self, path: str, body: dict[str, Any], optional: bool = False) -> Any:
        def send():
            return http_client.request("POST", self.url + path, body, timeout_s=self.timeout)

        if optional:  # a server without --slot-save-path answers 501: the recompute that follows starts afresh
            try:
                return send()
            except OSError as exc:
                raise self._unreachable(exc) from None
        return self._json(path, send)

    def _json(self, path: str, send) -> Any:
        try:
            answer = send()
        except OSError as exc:
            raise self._unreachable(exc) from None
        if answer.status != 200:
            raise EngineFailed(f"the llama-server at {self.url} answered {path} with HTTP {answer.status} "
                               f"{answer.text[:200]!r} after {self._sent} replayed request(s)")
        self._sent += path == "/completion"
        try:
            return answer.json()
        except ValueError:
            raise EngineFailed(f"the llama-server at {self.url} answered {path} with something not JSON") from None

    def _unreachable(self, exc: OSError) -> EngineFailed:
        done = f" after {self._sent} replayed request(s)" if self._sent else ""
        return EngineFailed(f"no llama-server answers at {self.url}{done} ({exc.strerror or exc}); start one with the "
                            f"recorded model and command line, and give its URL with --server")
