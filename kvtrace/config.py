"""Settings from the environment (documented in docs/tracing.md, "Configuration").

kvtrace reads ``KVTRACE_*`` variables, plus the standard OpenTelemetry ones
where they apply: ``OTEL_SDK_DISABLED``, ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES`` (resource), ``OTEL_EXPORTER_OTLP_*`` (endpoint and
headers read by the OTLP exporter itself; the time-out read here, in
milliseconds as the specification says) and ``OTEL_BSP_*`` (queue size, batch
size, delay and export time-out of kvtrace's span pipeline).

Every value is checked here, once: a setting kvtrace cannot use raises a
:class:`~kvtrace.errors.ConfigError` subclass whose message says what to set
instead, so ``kvtrace run`` can refuse it before the engine starts.
"""

from __future__ import annotations

import logging
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional
from urllib.parse import urlparse

from kvtrace import semconv
from kvtrace.credentials import read_secret_file
from kvtrace.errors import BadEndpoint, BadSetting, UnwritableDirectory
from kvtrace.safe_files import create_private

EXPORTERS = ("spool", "otlp", "clickhouse", "none")

MIN_SPOOL_ROTATE_BYTES = 16 * 1024
"""Smaller spool files would mean a file per batch or two; ingest keeps a record per file."""


def data_home(environ: Optional[Mapping[str, str]] = None) -> Path:
    """Per-user data directory (``$XDG_DATA_HOME/kvtrace``)."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "kvtrace"


def default_spool_dir(environ: Optional[Mapping[str, str]] = None) -> Path:
    env = os.environ if environ is None else environ
    return Path(env.get("KVTRACE_SPOOL_DIR") or data_home(env) / "spool")


def default_database_url(environ: Optional[Mapping[str, str]] = None) -> str:
    """``KVTRACE_CLICKHOUSE_URL``, else the URL in the file ``KVTRACE_CLICKHOUSE_URL_FILE`` names (a server's
    password kept off command lines and out of the environment), else the per-user embedded database."""
    env = os.environ if environ is None else environ
    if env.get("KVTRACE_CLICKHOUSE_URL"):
        return env["KVTRACE_CLICKHOUSE_URL"]
    if env.get("KVTRACE_CLICKHOUSE_URL_FILE"):
        return read_secret_file(env["KVTRACE_CLICKHOUSE_URL_FILE"], "KVTRACE_CLICKHOUSE_URL_FILE (--db-file)")
    return f"chdb://{data_home(env) / 'db'}"


ENABLED_VARIABLE = "KVTRACE_ENABLED"
"""Opts a process, and every process it starts, in to recording by engines that load kvtrace by
themselves (vLLM's plugin): ``kvtrace run`` and ``kvtrace.instrument()`` set it."""


def _truthy(value: Optional[str]) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes")


def recording_opted_in(environ: Optional[Mapping[str, str]] = None) -> bool:
    """``KVTRACE_ENABLED=1`` and not ``KVTRACE_DISABLED`` / ``OTEL_SDK_DISABLED``: an engine that loads
    kvtrace whenever it is installed records only then, so installing kvtrace alone records nothing."""
    env = os.environ if environ is None else environ
    return _truthy(env.get(ENABLED_VARIABLE)) and not recording_disabled(env)


def recording_disabled(environ: Mapping[str, str]) -> bool:
    """``KVTRACE_DISABLED`` (1, true, yes) or the OpenTelemetry SDK's ``OTEL_SDK_DISABLED=true``."""
    otel_disabled = (environ.get("OTEL_SDK_DISABLED") or "").strip().lower() == "true"
    return _truthy(environ.get("KVTRACE_DISABLED")) or otel_disabled


LLAMA_REPACK_VARIABLE = "KVTRACE_LLAMA_REPACK"
LLAMA_REPACK_CHOICES = ("default", "off")


def llama_repack(environ: Optional[Mapping[str, str]] = None) -> str:
    """``KVTRACE_LLAMA_REPACK``: ``off`` loads a user's ``llama_cpp.Llama`` without llama.cpp's weight repack,
    as kvtrace's own ``load_llama`` does; ``default`` (unset) leaves the repack as the user's code loads it."""
    env = os.environ if environ is None else environ
    return _Env(env).choice(LLAMA_REPACK_VARIABLE, "default", LLAMA_REPACK_CHOICES)


class _Env:
    """Typed, validated reads of one environment; every refusal says what to set instead."""

    def __init__(self, environ: Mapping[str, str]):
        self.environ = environ

    def raw(self, name: str) -> Optional[str]:
        value = self.environ.get(name)
        return None if value is None or value.strip() == "" else value.strip()

    def integer(self, name: str, default: int, minimum: Optional[int] = None, unit: str = "",
                maximum: Optional[int] = None) -> int:
        raw = self.raw(name)
        if raw is None:
            return default
        try:
            value = int(raw)
        except ValueError:
            raise BadSetting(f"{name}={raw!r} is not a whole number{' of ' + unit if unit else ''}; unset it for "
                             f"the default ({default}) or give one") from None
        if minimum is not None and value < minimum:
            raise BadSetting(f"{name}={raw!r} is too small: it must be at least {minimum}{' ' + unit if unit else ''}; "
                             f"unset it for the default ({default})")
        if maximum is not None and value > maximum:
            raise BadSetting(f"{name}={raw!r} is too large: it must be at most {maximum}{' ' + unit if unit else ''}; "
                             f"unset it for the default ({default})")
        return value

    def milliseconds(self, names: tuple[str, ...], default_ms: float) -> float:
        """The first of ``names`` that is set, as seconds: a positive, finite number of milliseconds."""
        for name in names:
            raw = self.raw(name)
            if raw is None:
                continue
            try:
                value = float(raw)
            except ValueError:
                value = math.nan
            if not (math.isfinite(value) and value > 0):
                raise BadSetting(f"{name}={raw!r} is not a positive number of milliseconds; unset it "
                                 f"(default {default_ms:g}) or give e.g. {default_ms:g}")
            return value / 1000
        return default_ms / 1000

    def choice(self, name: str, default: str, choices: tuple[str, ...]) -> str:
        value = (self.raw(name) or default).lower()
        if value not in choices:
            raise BadSetting(f"{name}={value!r} is not one of {', '.join(choices)}; "
                             f"unset it for the default ({default})")
        return value


def _is_server_url(url: str) -> bool:
    """An http(s) URL with a host and, if any, a numeric port."""
    parsed = urlparse(url)
    try:
        parsed.port
    except ValueError:
        return False
    return parsed.scheme in ("http", "https") and bool(parsed.hostname)


def _check_clickhouse_url(url: str) -> None:
    if not _is_server_url(url):
        raise BadEndpoint(
            f"KVTRACE_EXPORTER=clickhouse needs KVTRACE_CLICKHOUSE_URL to name a ClickHouse server "
            f"(http(s)://user:password@host:8123/database), got {url.split('@')[-1]!r}; engines write "
            "to the spool for the embedded database (KVTRACE_EXPORTER=spool)")


def _check_otlp_endpoint(env: _Env) -> None:
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        protocol = env.raw(name)
        if protocol is not None:
            if protocol != "http/protobuf":
                raise BadSetting(f"{name}={protocol!r}: kvtrace's otlp exporter speaks http/protobuf only; "
                                 "point it at the Collector's OTLP/HTTP port (4318) and unset it")
            break
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        endpoint = env.raw(name)
        if endpoint is not None:
            if not _is_server_url(endpoint):
                raise BadEndpoint(f"{name}={endpoint!r} is not the http(s)://host:port URL of an OpenTelemetry "
                                  "Collector (e.g. http://collector:4318)")
            return


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
    connect_timeout_s: float = 0.25
    """Longest wait for a sink's connection (ClickHouse server); env KVTRACE_CONNECT_TIMEOUT, ms."""
    export_timeout_s: float = 0.5
    """Longest wait for one batch to reach its sink before it goes to the spool; env OTEL_BSP_EXPORT_TIMEOUT
    (OTLP: OTEL_EXPORTER_OTLP_TRACES_TIMEOUT / OTEL_EXPORTER_OTLP_TIMEOUT first), ms."""
    shutdown_timeout_s: float = 2.0
    """Longest time the exit of the host may wait for kvtrace; env KVTRACE_SHUTDOWN_TIMEOUT, ms."""
    llama_repack: str = "default"
    """Whether instrumented llama-cpp-python models load with the weight repack off; env KVTRACE_LLAMA_REPACK
    (read again by the patch at each load, and checked here so ``kvtrace run`` refuses a bad value early)."""

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "Settings":
        """Settings from ``environ`` (default ``os.environ``); a value kvtrace cannot use raises ConfigError."""
        environ = os.environ if environ is None else environ
        env = _Env(environ)
        disabled = recording_disabled(environ)
        exporter = env.choice("KVTRACE_EXPORTER", "spool", EXPORTERS)
        clickhouse_url = default_database_url(environ)
        if exporter == "clickhouse":
            _check_clickhouse_url(clickhouse_url)
        if exporter == "otlp":
            _check_otlp_endpoint(env)
        queue_size = env.integer("OTEL_BSP_MAX_QUEUE_SIZE", 2048, minimum=1)
        batch_size = env.integer("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512, minimum=1)
        if batch_size > queue_size:
            raise BadSetting(f"OTEL_BSP_MAX_EXPORT_BATCH_SIZE={batch_size} is larger than the queue "
                             f"(OTEL_BSP_MAX_QUEUE_SIZE={queue_size}); make the batch at most the queue size")
        export_timeout_s = env.milliseconds(("OTEL_BSP_EXPORT_TIMEOUT",), 500)
        if exporter == "otlp":
            # The OpenTelemetry specification reads these in milliseconds (the Python SDK's own exporters
            # read seconds); kvtrace follows the specification and hands its exporter seconds itself.
            export_timeout_s = env.milliseconds(("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"),
                                                export_timeout_s * 1000)
        return cls(
            disabled=disabled,
            exporter=exporter,
            spool_dir=default_spool_dir(environ),
            clickhouse_url=clickhouse_url,
            capture_mode=env.choice("KVTRACE_CAPTURE", semconv.CAPTURE_HASHED, semconv.CAPTURE_MODES),
            hash_key=load_hash_key(environ),
            block_size=env.integer("KVTRACE_BLOCK_SIZE", 16, minimum=1),
            spool_rotate_bytes=env.integer("KVTRACE_SPOOL_ROTATE_BYTES", 64 * 1024 * 1024,
                                           minimum=MIN_SPOOL_ROTATE_BYTES, unit="bytes"),
            queue_size=queue_size,
            batch_size=batch_size,
            # A spool write is a local append: export almost at once, so a process killed right
            # after a request (vLLM stops its engine core that way) loses as little as possible.
            schedule_delay_ms=env.integer("OTEL_BSP_SCHEDULE_DELAY", 100 if exporter == "spool" else 1000,
                                          minimum=1, unit="milliseconds"),
            run_id=environ.get("KVTRACE_RUN_ID", ""),
            episode_id=environ.get("KVTRACE_EPISODE_ID", ""),
            turn=env.integer("KVTRACE_TURN", -1, minimum=semconv.TURN_MIN, maximum=semconv.TURN_MAX),
            arm=environ.get("KVTRACE_ARM", ""),
            connect_timeout_s=env.milliseconds(("KVTRACE_CONNECT_TIMEOUT",), 250),
            export_timeout_s=export_timeout_s,
            shutdown_timeout_s=env.milliseconds(("KVTRACE_SHUTDOWN_TIMEOUT",), 2000),
            llama_repack=llama_repack(environ),
        )


MIN_HASH_KEY_BYTES = 16
"""A shorter deployment key could be found by trying keys against one hash of a guessed prompt."""

log = logging.getLogger("kvtrace")
_LOOSE_KEY_FILES_WARNED: set[str] = set()
"""Key files this process has warned about already (settings are read more than once)."""


def load_hash_key(environ: Optional[Mapping[str, str]] = None) -> bytes:
    """The deployment secret that keys token hashes.

    ``KVTRACE_HASH_KEY`` wins; otherwise a random key is created once in the
    per-user data directory, so that every process of this user on this
    machine hashes alike (runs stay comparable) while nobody without the key
    can recover token ids.  Either must hold at least 16 bytes.
    """
    environ = os.environ if environ is None else environ
    explicit = environ.get("KVTRACE_HASH_KEY")
    if explicit:
        key = explicit.encode()
        if len(key) < MIN_HASH_KEY_BYTES:
            raise BadSetting(f"KVTRACE_HASH_KEY is {len(key)} bytes long; a hash key needs at least "
                             f"{MIN_HASH_KEY_BYTES} (e.g. the output of `openssl rand -hex 32`), or unset it "
                             "for a random key kept in the data home")
        return key
    path = data_home(environ) / "hash.key"
    key = _read_key_file(path)
    return key if key is not None else _create_key_file(path)


def _read_key_file(path: Path) -> Optional[bytes]:
    """The key file's bytes, ``None`` when there is none yet; one too short is refused, one that others
    may read is warned about."""
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as file:  # a FIFO must not block the read
            mode = os.fstat(file.fileno()).st_mode
            key = file.read() if stat.S_ISREG(mode) else b""
    except (FileNotFoundError, NotADirectoryError):
        return None  # not made yet (or cannot be: making it says why)
    except OSError as exc:
        raise UnwritableDirectory(f"cannot read the hash key {path} ({exc.strerror or exc}); "
                                  "fix its permissions or set KVTRACE_HASH_KEY") from None
    if len(key) < MIN_HASH_KEY_BYTES:
        raise BadSetting(f"the hash key file {path} holds {len(key)} bytes, fewer than {MIN_HASH_KEY_BYTES}; "
                         "remove it for a new random key (runs recorded with the old one no longer compare "
                         "with new ones) or set KVTRACE_HASH_KEY")
    if mode & 0o077 and str(path) not in _LOOSE_KEY_FILES_WARNED:
        _LOOSE_KEY_FILES_WARNED.add(str(path))
        log.warning("kvtrace: the hash key %s can be read by other users (mode %03o): whoever reads it can "
                    "confirm guessed prompts and tokens; run chmod 600 %s", path, mode & 0o777, path)
    return key


def _create_key_file(path: Path) -> bytes:
    """A new random key, made 0600 from its first byte; when processes race, the first one's key wins."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.unlink(missing_ok=True)  # left by a process of this pid that died before its link
        fd = create_private(tmp)
        try:
            os.write(fd, os.urandom(32))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # whole or not at all: a reader never sees a key half written
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
        key = _read_key_file(path)
    except OSError as exc:
        raise UnwritableDirectory(
            f"cannot keep the hash key in the data home {path.parent} ({exc.strerror or exc}); set XDG_DATA_HOME "
            "to a directory this user can write, or set KVTRACE_HASH_KEY (and KVTRACE_SPOOL_DIR)") from None
    if key is None:
        raise UnwritableDirectory(f"the hash key {path} vanished as it was made; set KVTRACE_HASH_KEY")
    return key
