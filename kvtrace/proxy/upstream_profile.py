"""What kind of server the proxy stands in front of: llama-server (its ``/props``: version, slots,
defaults, weight format), vLLM, or another OpenAI-compatible server (``/v1/models``)."""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional

from kvtrace.json_decode import loads
from kvtrace.proxy.margin_request import OPENAI_COMPATIBLE, UpstreamProfile
from kvtrace.proxy.upstream import Upstream, UpstreamBrokeOff, UpstreamUnreachable
from kvtrace.server_kind import server_of_models

log = logging.getLogger("kvtrace.proxy")


class _NotYet(Exception):
    """The upstream answered, but not yet as itself (503 while it starts)."""


class UpstreamProfiles:
    """What kind of server the upstream is (asked once: ``/props`` answers only on llama-server)."""

    def __init__(self, upstream: Upstream):
        self._upstream = upstream
        self._known: Optional[UpstreamProfile] = None
        self._lock = threading.Lock()

    def get(self) -> UpstreamProfile:
        return self.detected() or OPENAI_COMPATIBLE

    def detected(self) -> Optional[UpstreamProfile]:
        """The upstream's kind; ``None`` while it cannot be told (unreachable: asked again next time)."""
        if self._known is not None:
            return self._known
        with self._lock:
            if self._known is None:
                self._known = self._detect()
        return self._known

    def _get_json(self, path: str) -> Any:
        answer = self._upstream.request("GET", path, [], b"", timeout=10.0)
        body = answer.read()
        if answer.status == 503:  # llama-server loading its model answers so on every path
            raise _NotYet(f"{path} answered 503")
        return loads(body) if answer.status == 200 else None

    def _detect(self) -> Optional[UpstreamProfile]:
        try:
            llama_server = profile_of_props(self._get_json("/props"))
            if llama_server is not None:
                return llama_server
            models = self._get_json("/v1/models")
            if isinstance(models, dict):
                server, _ = server_of_models(models)
                return UpstreamProfile(engine="vllm" if server == "vllm" else OPENAI_COMPATIBLE.engine)
        except (UpstreamUnreachable, UpstreamBrokeOff, _NotYet, ValueError, AttributeError,
                IndexError, TypeError):
            log.debug("kvtrace proxy: the upstream's kind could not be told yet", exc_info=True)
            return None  # asked again with the next request
        return OPENAI_COMPATIBLE


def profile_of_props(props: Any) -> Optional[UpstreamProfile]:
    """llama-server's profile from its ``GET /props`` answer; ``None`` for any other document (another
    server's, or none). The proxy and the server experiment both tell llama-server so."""
    if isinstance(props, dict) and "default_generation_settings" in props:
        return llama_server_profile(props)
    return None


def llama_server_profile(props: dict[str, Any]) -> UpstreamProfile:
    """llama-server's ``GET /props``: its version, slot count and defaults."""
    defaults = props.get("default_generation_settings") or {}
    params = defaults.get("params") if isinstance(defaults.get("params"), dict) else {}
    slots = props.get("total_slots")
    settings = {"total_slots": slots, "n_ctx": defaults.get("n_ctx"), "model_path": props.get("model_path"),
                "cache_prompt_default": params.get("cache_prompt")}
    dry_last_n = params.get("dry_penalty_last_n")
    dry_multiplier = params.get("dry_multiplier")
    return UpstreamProfile(
        engine="llama-server",
        llama_server=True,
        default_n_probs=int(params.get("n_probs") or 0),
        default_post_sampling_probs=bool(params.get("post_sampling_probs")),
        version=str(props.get("build_info") or ""),
        weight_format=weight_format_name(str(props.get("model_ftype") or "")),
        total_slots=slots if isinstance(slots, int) else None,
        default_dry_multiplier=float(dry_multiplier) if isinstance(dry_multiplier, (int, float)) else 1.0,
        default_dry_penalty_last_n=dry_last_n if isinstance(dry_last_n, int) else None,
        settings={k: v for k, v in settings.items() if v is not None},
    )


_SIZES = {"Small": "S", "Medium": "M", "Large": "L"}


def weight_format_name(ftype: str) -> str:
    """llama.cpp's file-type name (``all F32``, ``Q4_K - Medium``) as kvtrace names formats (F32, Q4_K_M)."""
    name = ftype.removesuffix(" (guessed)").removeprefix("all ").strip()
    name, _, detail = name.partition(" - ")
    return f"{name}_{_SIZES[detail]}" if detail in _SIZES else name
