"""Settings from the environment (documented in README.md, "Configuration").

kvtrace reads ``KVTRACE_*`` variables, plus the standard OpenTelemetry ones
where they apply: ``OTEL_SDK_DISABLED``, ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES`` (resource), ``OTEL_EXPORTER_OTLP_*`` (read by the
OTLP exporter itself) and ``OTEL_BSP_*`` (queue size, batch size, delay of
kvtrace's span pipeline).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvtrace import semconv
from kvtrace.errors import ConfigError

EXPORTERS = ("spool", "otlp", "clickhouse", "none")


def data_home() -> Path:
    """Per-user data directory (``$XDG_DATA_HOME/kvtrace``)."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "kvtrace"


def default_spool_dir() -> Path:
    return Path(os.environ.get("KVTRACE_SPOOL_DIR") or data_home() / "spool")


def default_database_url() -> str:
    return os.environ.get("KVTRACE_CLICKHOUSE_URL") or f"chdb://{data_home() / 'db'}"


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer; unset it or give a whole number") from None


def _choice_env(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = (os.environ.get(name) or default).strip().lower()
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(choices)}")
    return value


@dataclass(frozen=True)
class Settings:
    """What the recorder needs to know, resolved once per process."""

    disabled: bool
    exporter: str
    spool_dir: Path
    clickhouse_url: str
    capture_mode: str
    hash_key: bytes
    block_size: int
    spool_rotate_bytes: int
    queue_size: int
    batch_size: int
    schedule_delay_ms: int
    run_id: str
    episode_id: str
    turn: int
    arm: str = ""
    """Experiment arm label for every request of this process (env KVTRACE_ARM); baggage overrides it."""

    @classmethod
    def from_env(cls) -> "Settings":
        disabled = os.environ.get("KVTRACE_DISABLED", "").lower() in ("1", "true", "yes") or (
            os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true"
        )
        exporter = _choice_env("KVTRACE_EXPORTER", "spool", EXPORTERS)
        block_size = _int_env("KVTRACE_BLOCK_SIZE", 16)
        if block_size <= 0:
            raise ConfigError(f"KVTRACE_BLOCK_SIZE must be positive, got {block_size}")
        return cls(
            disabled=disabled,
            exporter=exporter,
            spool_dir=default_spool_dir(),
            clickhouse_url=default_database_url(),
            capture_mode=_choice_env("KVTRACE_CAPTURE", semconv.CAPTURE_HASHED, semconv.CAPTURE_MODES),
            hash_key=load_hash_key(),
            block_size=block_size,
            spool_rotate_bytes=_int_env("KVTRACE_SPOOL_ROTATE_BYTES", 64 * 1024 * 1024),
            queue_size=_int_env("OTEL_BSP_MAX_QUEUE_SIZE", 2048),
            batch_size=_int_env("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512),
            # A spool write is a local append: export almost at once, so a process killed right
            # after a request (vLLM stops its engine core that way) loses as little as possible.
            schedule_delay_ms=_int_env("OTEL_BSP_SCHEDULE_DELAY", 100 if exporter == "spool" else 1000),
            run_id=os.environ.get("KVTRACE_RUN_ID", ""),
            episode_id=os.environ.get("KVTRACE_EPISODE_ID", ""),
            turn=_int_env("KVTRACE_TURN", -1),
            arm=os.environ.get("KVTRACE_ARM", ""),
        )


def load_hash_key() -> bytes:
    """The deployment secret that keys token hashes.

    ``KVTRACE_HASH_KEY`` wins; otherwise a random key is created once in the
    per-user data directory, so that every process of this user on this
    machine hashes alike (runs stay comparable) while nobody without the key
    can recover token ids.
    """
    explicit = os.environ.get("KVTRACE_HASH_KEY")
    if explicit:
        return explicit.encode()
    path = data_home() / "hash.key"
    try:
        return path.read_bytes()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    key = os.urandom(32)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(key)
    os.chmod(tmp, 0o600)
    try:
        os.link(tmp, path)  # first writer wins; concurrent processes read its key
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_bytes()
