"""Opening the ClickHouse that holds the spans: embedded chDB or a server.

URLs:

* ``chdb:///abs/path`` — embedded database on disk (default: per-user data dir);
* ``chdb://memory``    — embedded, in memory (tests, one-off analysis);
* ``http(s)://user:password@host:port/database`` — any ClickHouse server.

An on-disk chDB database can be opened by one process at a time; when it is
busy the error names the holder and says what to do instead of showing
chDB's raw message.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlparse

from kvtrace.config import default_database_url
from kvtrace.errors import ConfigError, DatabaseBusy, DatabaseUnreachable


def describe(url: str) -> str:
    """The URL without its password, for messages."""
    parsed = urlparse(url)
    if parsed.password:
        netloc = parsed.netloc.replace(f":{parsed.password}@", ":***@")
        return parsed._replace(netloc=netloc).geturl()
    return url


def chdb_path(url: str) -> str | None:
    """Filesystem path of an embedded database URL (``None`` for memory or servers)."""
    if not url.startswith("chdb:"):
        return None
    rest = url[len("chdb:"):].lstrip("/")
    if rest in ("", "memory", ":memory:"):
        return None
    return "/" + rest


def connect(url: str | None = None):
    """A clickhouse-connect client for ``url`` (default: ``KVTRACE_CLICKHOUSE_URL`` or the per-user chDB)."""
    import clickhouse_connect

    url = url or default_database_url()
    parsed = urlparse(url)
    if parsed.scheme == "chdb":
        path = chdb_path(url)
        if path:
            try:
                Path(path).mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"the embedded database {path} cannot be created there "
                                  f"({exc.strerror or exc}); pass --db chdb:///a/writable/directory") from None
            dsn = f"chdb://{path}"
        else:
            dsn = "chdb://memory"
        try:
            client = clickhouse_connect.get_client(dsn=dsn)
            client.command("SELECT 1")
        except Exception as exc:
            raise _chdb_error(url, path, exc) from None
        return client
    if parsed.scheme not in ("http", "https"):
        raise ConfigError(
            f"database URL {describe(url)!r} is not understood; use chdb:///path, chdb://memory "
            "or http(s)://user:password@host:port/database"
        )
    database = parsed.path.strip("/") or "default"
    try:
        port = parsed.port or (8443 if parsed.scheme == "https" else 8123)
    except ValueError:
        raise ConfigError(f"database URL {describe(url)!r} has no valid port; e.g. http://host:8123/db") from None
    try:
        client = clickhouse_connect.get_client(
            host=parsed.hostname or "localhost",
            port=port,
            username=unquote(parsed.username or "default"),
            password=unquote(parsed.password or ""),
            database=database,
            secure=parsed.scheme == "https",
            connect_timeout=5,
            send_receive_timeout=60,
        )
        client.command("SELECT 1")
    except Exception as exc:
        raise DatabaseUnreachable(
            f"cannot reach ClickHouse at {describe(url)}: {_first_line(exc)}. "
            "Check the host, port and credentials, or drop --db to use the embedded database."
        ) from None
    return client


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _chdb_error(url: str, path: str | None, exc: Exception) -> Exception:
    text = str(exc)
    if path and ("EmbeddedServer" in text or "Cannot lock file" in text or "already initialized" in text):
        holder = _holder_pid(path)
        who = f"process {holder}" if holder and holder != os.getpid() else "another process"
        if holder == os.getpid() or "already initialized" in text:
            who = "this process (another embedded database is already open here)"
        return DatabaseBusy(
            f"the embedded database {path} is in use by {who}; an embedded database opens in one "
            "process at a time. Wait for it to finish (or stop it), or pass --db chdb:///another/path, "
            "or use a ClickHouse server (--db http://host:8123)."
        )
    return DatabaseUnreachable(f"cannot open the embedded database {url}: {_first_line(exc)}")


def _holder_pid(path: str) -> int | None:
    try:
        for line in Path(path, "status").read_text().splitlines():
            if line.startswith("PID:"):
                return int(line.split(":", 1)[1])
    except (OSError, ValueError):
        return None
    return None
