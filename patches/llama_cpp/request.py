"""One record per generation call: ``Llama.create_completion`` / ``create_chat_completion``.

The call starts a :class:`~kvtrace.recording.records.RequestRecord` (unless it is nested in a call already
being recorded: a chat completion calls ``create_completion``), binds it to the thread while the
engine works, and finishes it when the call returns or raises.  With ``stream=True`` the engine
works while the caller iterates, so the record is bound during each step and finished when the
stream ends, fails, or is closed early.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Callable, Optional

from kvtrace import semconv as sc
from kvtrace.patches.llama_cpp import config
from kvtrace.patches.llama_cpp.batching import record_batch_composition
from kvtrace.patches.llama_cpp.calls import CALLS, CallState
from kvtrace.patches.llama_cpp.engine import ENGINE, FAILURES
from kvtrace.patches.llama_cpp.prompt_cache import CACHE_CLASSES
from kvtrace.recording.recorder import get_recorder


def completion_wrapper(operation: str) -> Callable:
    """The wrapper of one completion method; ``operation`` names it in the record."""

    def wrapper(wrapped, instance, args, kwargs):
        state = begin(instance, operation, kwargs)
        if state is None:
            return wrapped(*args, **kwargs)
        token = CALLS.bind(state)
        try:
            result = wrapped(*args, **kwargs)
        except BaseException as exc:
            end(state, error=exc)
            raise
        finally:
            CALLS.unbind(token)
        if isinstance(result, Iterator):  # stream=True: the engine works while the caller iterates
            return traced_stream(state, result)
        end(state, result=result)
        return result

    return wrapper


def begin(llama: Any, operation: str, kwargs: dict) -> Optional[CallState]:
    """Start a record unless this call is nested in one already being recorded."""
    if CALLS.of(llama) is not None:
        return None  # create_chat_completion → create_completion: one request, one record
    recorder = None
    try:
        recorder = get_recorder()  # may raise on a malformed KVTRACE_* setting: never the host's problem
        if recorder is None:
            return None
        record = recorder.start_request(ENGINE, operation=operation, model=config.model_name(llama, kwargs))
        state = CallState(recorder=recorder, record=record, llama=llama)
        record.config.update(config.static_config(llama))
        record.config[sc.CACHE_SETTINGS] = config.cache_settings(llama)
        if kwargs.get("max_tokens") is not None:
            record.config[sc.GEN_AI_REQUEST_MAX_TOKENS] = int(kwargs["max_tokens"])
        cache = getattr(llama, "cache", None)
        if cache is not None:
            CACHE_CLASSES.cover(type(cache))
        return state
    except Exception:
        FAILURES.count("request start", recorder)
        return None


def end(state: CallState, result: Any = None, error: Optional[BaseException] = None,
        finish_reason: Optional[str] = None) -> None:
    """Finish the record once: the error or finish reason, then hand it to the recorder."""
    if state.finished:
        return
    state.finished = True
    record = state.record
    try:
        if state.unwatch_eval is not None:  # the engine never evaluated the prompt
            state.unwatch_eval()
        if error is not None:
            record.error, record.error_detail = type(error).__name__, str(error)
        reason = finish_reason or _finish_reason(result)
        if reason:
            record.finish_reason = reason
        record_batch_composition(record, state.llama)
    except Exception:
        FAILURES.count("request end", state.recorder)
    state.recorder.finish(record)


def traced_stream(state: CallState, chunks: Iterator) -> Iterator:
    """Yield the engine's chunks unchanged, binding the request while each one is produced.

    The record is finished when the stream ends, fails, or is closed early (``finish_reason``
    ``cancelled`` unless the engine gave one).  llama-cpp-python puts the finish reason on a
    stream's last chunk, so only that chunk is read.  Per chunk this costs the bind and unbind
    (the context variable's own methods: no Python frame).
    """
    bind, unbind = CALLS.binder()
    chunk: Any = None
    try:
        while True:
            token = bind(state)
            try:
                chunk = next(chunks)
            except StopIteration:
                break
            finally:
                unbind(token)
            yield chunk
    except GeneratorExit:
        _close_quietly(chunks, state)
        end(state, finish_reason=_finish_reason(chunk) or sc.FINISH_CANCELLED)
        raise
    except BaseException as exc:
        end(state, error=exc, finish_reason=_finish_reason(chunk))
        raise
    end(state, finish_reason=_finish_reason(chunk))


def _close_quietly(chunks: Iterator, state: CallState) -> None:
    """Close the engine's generator with the request bound (its cleanup may still touch the cache)."""
    token = CALLS.bind(state)
    try:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
    except Exception:
        pass
    finally:
        CALLS.unbind(token)


def _finish_reason(result: Any) -> Optional[str]:
    """The finish reason of a completion or a stream's chunk; ``None`` where it has none (never raises)."""
    try:
        if isinstance(result, dict):
            choices = result.get("choices") or []
            if choices and isinstance(choices[0], dict):
                return choices[0].get("finish_reason")
    except Exception:
        pass
    return None
