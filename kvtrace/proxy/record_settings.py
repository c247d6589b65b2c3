"""The server-wide settings each of the proxy's records carries, derived once per server rather than per record.

Every record of one upstream carries the same cache settings, numerics and KV cache type (a request may add
its own ``cache_prompt``, ``cache_salt`` or ``id_slot``). They are kept here as the span attributes' JSON text
(``settings_text``, which the recorder takes as it is), so a record neither copies the dicts nor has them
encoded again on the span's thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from kvtrace.proxy.margin_request import UpstreamProfile
from kvtrace.recording.settings_texts import settings_text

REQUEST_CACHE_FIELDS = ("cache_prompt", "cache_salt", "id_slot")
"""A request's own members that change its cache settings."""


@dataclass(frozen=True)
class ServerSettings:
    """What one server's records carry, whatever the request."""

    cache: dict[str, Any]
    """The cache settings before a request's own (read, never changed: copied where a request adds to them)."""
    cache_text: Optional[str]
    """``cache`` as the span attribute's text (``None``: no cache settings known)."""
    numerics_text: Optional[str]
    kv_cache_type: Optional[str]


_last: tuple[Any, Any, Optional[ServerSettings]] = (None, None, None)
"""(profile, the log's settings pair, what they give): a proxy serves one server, so one entry is enough. The
objects it was derived from are held, so that a later object is never taken for them by its ``id``."""


def server_settings(profile: UpstreamProfile,
                    logged: Optional[tuple[dict[str, Any], dict[str, Any]]]) -> ServerSettings:
    """The settings of ``profile``'s server with what its log stated (``logged``: cache settings and numerics,
    ``TaskProvenance.server_settings``; ``None`` without the log). Derived again only when either is another
    object than the last call's."""
    global _last
    last = _last  # one read: another thread may replace it meanwhile
    if last[0] is profile and last[1] is logged and last[2] is not None:
        return last[2]
    cache = dict(profile.settings)
    numerics: dict[str, Any] = {}
    kv = None
    if logged is not None:
        settings, numerics = logged
        cache.update(settings)
        cache_mib = settings.get("cache_ram_mib")
        if isinstance(cache_mib, int) and cache_mib > 0:
            cache.update(prompt_cache="llama-server", capacity_bytes=cache_mib << 20)
        if "type_k" in numerics:
            k, v = numerics["type_k"], numerics.get("type_v", numerics["type_k"])
            kv = k if k == v else f"{k}/{v}"
    derived = ServerSettings(cache, settings_text(cache) if cache else None,
                             settings_text(numerics) if numerics else None, kv)
    _last = (profile, logged, derived)
    return derived


def request_cache_settings(server: ServerSettings, request: dict[str, Any]) -> Any:
    """A record's cache settings: the server's text, or, where the request sets its own, a dict of both
    (``None``: none known)."""
    if not any(name in request for name in REQUEST_CACHE_FIELDS):
        return server.cache_text
    cache = dict(server.cache)
    if "cache_prompt" in request:
        cache["cache_prompt"] = request["cache_prompt"]
    for name in ("cache_salt", "id_slot"):
        if name in request:
            cache[name] = request[name] if name == "id_slot" else True  # a salt is a secret
    return cache or None
