"""A shadow twin's state kept out of llama-server's slots.

A twin recomputes its prompt in a slot and leaves its own KV state there. The original's next turn
then reuses the twin's state instead of the original's, and where the server's one-token and batched
kernels round differently (AVX-512 builds) its logprobs change in the last digits (docs/findings.md,
"A twin's state in the next turn"). When the proxy knows the original's slot (``--llama-server-log``)
and the server keeps slot files (``--slot-save-path``), it saves that slot, pins the twin to it
(``id_slot``) and restores it afterwards: the server's state is then the original's, bit for bit.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from typing import Callable, Optional

from kvtrace import semconv as sc
from kvtrace.proxy.margin_request import UpstreamProfile
from kvtrace.proxy.upstream import Upstream, UpstreamBrokeOff, UpstreamUnreachable
from kvtrace.recording.records import RequestRecord

log = logging.getLogger("kvtrace.proxy")

SLOT_FILE = "kvtrace-shadow-slot{slot}.bin"
"""One file per slot in the server's ``--slot-save-path``, rewritten by each twin: bounded on its disk."""
ACTION_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class SavedSlot:
    slot: int
    sent_before: int
    """Traced requests this proxy had sent upstream when the slot was saved."""


class SlotKeeper:
    """Saves the original's slot before its twin and restores it after (llama-server only)."""

    def __init__(self, upstream: Upstream, sent_upstream: Callable[[], int]):
        self._upstream = upstream
        self._sent_upstream = sent_upstream
        self._slot_files: Optional[bool] = None  # whether the server keeps slot files: known after one save
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def save(self, profile: UpstreamProfile, record: RequestRecord) -> Optional[SavedSlot]:
        """The original's slot saved, or ``None`` (the twin then leaves its state where it runs)."""
        if not profile.llama_server:
            return None
        slot = record.config.get(sc.SERVER_SLOT_ID)
        if not isinstance(slot, int) or isinstance(slot, bool):
            self._warn_once("no slot", "the proxy does not know which slot served a request without "
                            "--llama-server-log")
            return None
        if self._slot_files is False:
            return None
        sent_before = self._sent_upstream()
        status = self._action(slot, "save")
        if status == 501:  # "Start it with `--slot-save-path`"
            self._slot_files = False
            self._warn_once("no slot files", "llama-server was started without --slot-save-path")
            return None
        if status != 200:
            return None
        self._slot_files = True
        return SavedSlot(slot, sent_before)

    def restore(self, saved: Optional[SavedSlot]) -> bool:
        """Put the saved slot back; false (the twin's state stays) when none was saved, or when a request
        other than the twin went upstream meanwhile: it may have run in that slot since."""
        if saved is None or self._sent_upstream() != saved.sent_before + 1:
            return False
        return self._action(saved.slot, "restore") == 200

    def _action(self, slot: int, action: str) -> int:
        body = json.dumps({"filename": SLOT_FILE.format(slot=slot)}).encode()
        try:
            answer = self._upstream.request("POST", f"/slots/{slot}?action={action}",
                                            [(b"content-type", b"application/json")], body,
                                            timeout=ACTION_TIMEOUT_S)
            answer.read()
            return answer.status
        except (UpstreamUnreachable, UpstreamBrokeOff):
            return 0

    def _warn_once(self, key: str, why: str) -> None:
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        log.warning("kvtrace proxy: %s, so a shadow twin's state stays in the slot it ran in and a later cache "
                    "hit may reuse it (counted in shadow_twins_state_left; docs/proxy.md, \"Shadow twins\")", why)
