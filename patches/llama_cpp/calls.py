"""The generation call being recorded: its state, and which thread it is bound to.

A call is bound to the executing thread (through a context variable) only while the engine works
on it: during ``create_completion`` / ``create_chat_completion``, and during each step of a stream.
Every other hook finds its request here, so nothing is recorded for a ``Llama`` that kvtrace did
not see start a call.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any, Callable, Optional

from kvtrace.recording.records import CacheEvent, RequestRecord, StateOrigin
from kvtrace.recording.recorder import Recorder


@dataclass
class CallState:
    """What kvtrace tracks while one generation call runs on one ``Llama``."""

    recorder: Recorder
    record: RequestRecord
    llama: Any
    prompt: Optional[list[int]] = None
    live_tokens_before: int = 0
    """``n_tokens`` when ``generate`` was called: the live context llama.cpp could reuse."""
    live_prefix: int = 0
    """Longest common prefix of the live context and the prompt."""
    live_compared: bool = False
    """Whether ``live_prefix`` was compared (``generate`` with ``reset`` and a live context): what an
    in-context reuse is verified against."""
    unwatch_eval: Optional[Callable[[], None]] = None
    """Removes the watcher that shadows ``llama.eval`` until the request's first eval (:mod:`.reuse`)."""
    pending_lookup: Optional[CacheEvent] = None
    """The prompt-cache lookup that found a state; a hit once ``load_state`` restores it."""
    restored: bool = False
    restored_tokens: Any = None
    """The tokens the restored state's KV data holds, where they are not the ``input_ids`` it was handed out
    with (a copy of a stored state: those of the state as stored); ``None``: its own ``input_ids``."""
    restored_origin: Optional[StateOrigin] = None
    """Who stored the KV data of a restored copy, where kvtrace saw it stored; otherwise the lookup's
    source (``record.state_origin``) is the restored state's origin."""
    finished: bool = False


class CallRegistry:
    """The call each thread is recording (at most one; a nested call belongs to the outer one)."""

    def __init__(self) -> None:
        self._current: contextvars.ContextVar[Optional[CallState]] = contextvars.ContextVar(
            "kvtrace_llama_call", default=None)

    def bind(self, state: CallState) -> contextvars.Token:
        """Bind ``state`` to this thread until :meth:`unbind` (plain calls: this runs per stream step)."""
        return self._current.set(state)

    def unbind(self, token: contextvars.Token) -> None:
        self._current.reset(token)

    def binder(self) -> tuple[Callable[[CallState], contextvars.Token], Callable[[contextvars.Token], None]]:
        """:meth:`bind` and :meth:`unbind` as the context variable's own methods, for a stream's every step."""
        return self._current.set, self._current.reset

    def current(self) -> Optional[CallState]:
        """The unfinished call bound to this thread, if any."""
        state = self._current.get()
        return None if state is None or state.finished else state

    def of(self, llama: Any) -> Optional[CallState]:
        """The unfinished call this thread records on ``llama`` (``None`` for any other ``Llama``).

        Runs on every sampled token: one context-variable read and two attribute checks.
        """
        state = self._current.get()
        return state if state is not None and state.llama is llama and not state.finished else None


CALLS = CallRegistry()
