"""Shadow twins (``kvtrace proxy --shadow RATE``): the cold recompute of a sampled share of live requests.

``margin_shift`` and its alerts compare a request served from cache with a recompute of the same
prompt, and live traffic rarely sends one prompt both ways. So once a request that reused cached
state has been answered, the proxy may send its twin: the same request with the server's own cache
bypass, recorded as a request of arm ``shadow``, a child of the original's span, with the same
prompt hash. The twin and its answer never reach a client. docs/proxy.md ("Shadow twins") says
what twins cost and how to size the rate.

The budget keeps twins off the critical path: at most ``in_flight`` at once, only while at most
``busy`` other requests are upstream through this proxy (and llama-server has an idle slot, its
``/slots``), and at most ``tokens_per_minute`` prompt plus generated tokens. A twin the budget has
no room for is dropped and counted, never queued.
"""

from __future__ import annotations

import json
import logging
import random
import secrets
from typing import Any, Callable, Optional

from kvtrace import semconv as sc
from kvtrace.errors import ConfigError
from kvtrace.exchanges.recorder import trace_headers
from kvtrace.json_decode import loads
from kvtrace.llama_server.slots import SlotKeeper
from kvtrace.proxy.background import Background
from kvtrace.proxy.http1 import Request
from kvtrace.proxy.limits import ShadowBudget
from kvtrace.proxy.margin_request import UpstreamProfile
from kvtrace.proxy.shadow_ledger import ShadowLedger
from kvtrace.proxy.upstream import Upstream, UpstreamBrokeOff, UpstreamUnreachable
from kvtrace.recording.records import RequestRecord
from kvtrace.recording.stats import (SHADOW_TWINS_DROPPED, SHADOW_TWINS_SENT, SHADOW_TWINS_STATE_LEFT,
                                     SHADOW_TWINS_UNSUPPORTED)

log = logging.getLogger("kvtrace.proxy")


def cache_bypass(profile: UpstreamProfile) -> Optional[dict[str, Any]]:
    """The request members that make this server recompute the prompt; ``None``: it has no bypass."""
    if profile.llama_server:
        return {"cache_prompt": False}
    if profile.engine == "vllm":
        return {"cache_salt": secrets.token_hex(16)}  # a salt no cached block was stored under
    return None  # llama-cpp-python's server and other OpenAI-compatible servers


def refuse_without_bypass(profile: Optional[UpstreamProfile]) -> None:
    """``kvtrace proxy --shadow`` at start: an upstream known to have no bypass is a ``ConfigError``
    (one that cannot be reached yet is asked with the first request; its twins then count as unsupported)."""
    if profile is None:
        log.warning("kvtrace proxy: the upstream cannot be reached yet; whether it can serve shadow twins "
                    "is asked with the first request")
    elif cache_bypass(profile) is None:
        raise ConfigError(f"--shadow: the upstream ({profile.engine}) has no cache bypass, so a twin could not "
                          "recompute its prompt; shadow twins need llama-server or vLLM. Run without --shadow")


class _Discarded:
    """Where a twin's answer goes: nowhere (the interface of ``http1.Responder``)."""

    started = committed = finished = client_gone = False

    def start(self, status: int, headers: Any) -> None:
        self.started = True

    def send(self, data: bytes) -> None:
        pass

    def end(self, data: bytes = b"") -> None:
        self.finished = True


class Shadows:
    """Decides, sends and counts twins; ``send(request, responder)`` is the proxy's own request handler."""

    def __init__(self, budget: ShadowBudget, upstream: Upstream, send: Callable[[Request, Any], None],
                 count: Callable[[str], None], others_upstream: Callable[[RequestRecord], int],
                 sent_upstream: Callable[[], int], ledger: ShadowLedger, rng: Optional[random.Random] = None):
        self.budget = budget
        self._upstream = upstream
        self._send = send
        self._count = count
        self._others_upstream = others_upstream
        self._rng = rng or random.Random()
        self._in_flight = Background(budget.in_flight, name="kvtrace-shadow")
        self._ledger = ledger
        self._warned_unsupported = False
        self._slots = SlotKeeper(upstream, sent_upstream)

    def offer(self, request: dict[str, Any], target: str, profile: UpstreamProfile, record: RequestRecord) -> None:
        """After the original's record is made: send its twin if it is sampled and the budget has room."""
        if record.config.get(sc.ARM) == sc.ARM_SHADOW or record.error or record.finish_reason == sc.FINISH_CANCELLED:
            return  # a twin itself, or an answer that did not complete
        if record.reused_tokens <= 0 and record.config.get(sc.CACHE_REUSED_TOKENS_SOURCE) != sc.REUSED_SOURCE_UNKNOWN:
            return  # no cache path to compare (a server that does not say what it reused may have hit)
        if self._rng.random() >= self.budget.rate:
            return
        bypass = cache_bypass(profile)
        if bypass is None:
            self._unsupported(profile)
            return
        cost = record.prompt_tokens + len(record.output_token_ids)
        if not self._ledger.take_tokens(cost):
            self._count(SHADOW_TWINS_DROPPED)
            return
        if not self._ledger.take_twin():  # as many twins upstream as the whole proxy may have
            self._drop(cost)
            return
        if not self._in_flight.try_run(lambda: self._run({**request, **bypass}, target, profile, record, cost)):
            self._ledger.twin_done()
            self._drop(cost)

    def _drop(self, cost: int) -> None:
        self._ledger.refund_tokens(cost)  # a twin never sent spends none of the minute's tokens
        self._count(SHADOW_TWINS_DROPPED)

    def _run(self, twin: dict[str, Any], target: str, profile: UpstreamProfile, record: RequestRecord,
             cost: int) -> None:
        try:
            if not self._room_upstream(profile, record):
                self._drop(cost)
                return
            twin["stream"] = False
            twin.pop("stream_options", None)
            saved = self._slots.save(profile, record)
            if saved is not None:
                twin["id_slot"] = saved.slot
            headers = trace_headers(record, arm=sc.ARM_SHADOW)
            shadow = Request("POST", target, target.split("?", 1)[0], [(b"content-type", b"application/json")] + [
                (name.encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()],
                json.dumps(twin, ensure_ascii=False).encode("utf-8"))
            self._count(SHADOW_TWINS_SENT)
            try:
                self._send(shadow, _Discarded())
            finally:
                if profile.llama_server and not self._slots.restore(saved):
                    self._count(SHADOW_TWINS_STATE_LEFT)
        except Exception:
            log.warning("kvtrace proxy: a shadow twin failed", exc_info=True)
        finally:
            self._ledger.twin_done()

    def _room_upstream(self, profile: UpstreamProfile, record: RequestRecord) -> bool:
        """Whether the server has room for a twin: at most ``busy`` other requests upstream through this
        proxy (on a CPU every sequence a server runs costs its compute, so a free slot in its batch is
        not spare room), and on llama-server a slot processing nothing, whoever sent the others (its
        ``/slots``; started without it, ``--no-slots``: assumed so; not reachable: no)."""
        if self._others_upstream(record) > self.budget.busy:
            return False
        if not profile.llama_server:
            return True
        try:
            answer = self._upstream.request("GET", "/slots", [], b"", timeout=5.0)
            body = answer.read()
            if answer.status != 200:
                return True
            return any(isinstance(s, dict) and not s.get("is_processing") for s in loads(body))
        except (UpstreamUnreachable, UpstreamBrokeOff, ValueError, TypeError):
            return False

    def _unsupported(self, profile: UpstreamProfile) -> None:
        self._count(SHADOW_TWINS_UNSUPPORTED)
        if not self._warned_unsupported:
            self._warned_unsupported = True
            log.warning("kvtrace proxy: the upstream (%s) has no cache bypass: no shadow twins are sent",
                        profile.engine)

    def close(self, timeout_s: float = 60.0) -> None:
        """Wait for the twins in flight (their records go out before the proxy's recorder flushes)."""
        self._in_flight.close(timeout_s)
