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

import contextlib
import logging
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Iterator
from urllib.parse import unquote, urlparse

from kvtrace.config import default_database_url
from kvtrace.credentials import without_password as describe  # the URL in messages (also for other modules)
from kvtrace.errors import ConfigError, DatabaseBusy, DatabaseUnreachable
from kvtrace.http_client import request
from kvtrace.safe_files import private_dir


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
    import clickhouse_connect  # deferred, heavy (it loads chDB, ~2 s): not for `--help` or a usage error

    url = url or default_database_url()
    parsed = urlparse(url)
    if parsed.scheme == "chdb":
        path = chdb_path(url)
        if path:
            try:
                private_dir(Path(path))  # it holds every span: its user's alone
            except OSError as exc:
                raise ConfigError(f"the embedded database {path} cannot be created there "
                                  f"({exc.strerror or exc}); pass --db chdb:///a/writable/directory") from None
            dsn = f"chdb://{path}"
        else:
            dsn = "chdb://memory"
        try:
            with _chdb_output_held():
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
    try:
        parsed.port  # a port that is not a number raises here
    except ValueError:
        raise ConfigError(f"database URL {describe(url)!r} has no valid port; e.g. http://host:8123/db") from None
    try:
        client = server_client(url, connect_timeout_s=CONNECT_TIMEOUT_S, read_timeout_s=QUERY_TIMEOUT_S,
                               first_answer_s=CONNECT_TIMEOUT_S)
    except Exception as exc:
        raise DatabaseUnreachable(
            f"cannot reach ClickHouse at {describe(url)}: {_first_line(exc)}. "
            "Check the host, port and credentials, or drop --db to use the embedded database."
        ) from None
    return client


CONNECT_TIMEOUT_S = 5.0
"""How long a command waits for a database server to take the connection, and again for its first answer."""
QUERY_TIMEOUT_S = 60.0
"""How long a command waits for each answer of a server that answered ``/ping``."""


def server_client(url: str, connect_timeout_s: float, read_timeout_s: float, first_answer_s: float | None = None):
    """A clickhouse-connect client for a server URL (``http(s)://``), with these time-outs.

    Raises whatever connecting raised.  A server that is dead, or takes the connection and never
    answers, fails within the connect time-out plus ``first_answer_s`` (default: the read time-out):
    ``/ping`` (one socket, no retries) must answer in it, and so must the queries clickhouse-connect
    sends while it builds the client; the read time-out is each later answer's.
    """
    import clickhouse_connect  # deferred, heavy: as in connect()
    from urllib3 import Timeout

    parsed = urlparse(url)
    host = parsed.hostname or "localhost"
    port = parsed.port or (8443 if parsed.scheme == "https" else 8123)
    first_answer_s = read_timeout_s if first_answer_s is None else first_answer_s
    _ping(parsed.scheme, host, port, connect_timeout_s, first_answer_s)
    # clickhouse-connect counts its time-outs in whole seconds: /ping first keeps a dead server's cost exact.
    client = clickhouse_connect.get_client(
        host=host,
        port=port,
        username=unquote(parsed.username or "default"),
        password=unquote(parsed.password or ""),
        database=parsed.path.strip("/") or "default",
        secure=parsed.scheme == "https",
        connect_timeout=max(1, math.ceil(connect_timeout_s)),
        send_receive_timeout=max(1, math.ceil(first_answer_s)),
    )
    client.command("SELECT 1")
    client.timeout = Timeout(connect=connect_timeout_s, read=read_timeout_s)  # exact from here on
    return client


def _ping(scheme: str, host: str, port: int, connect_timeout_s: float, answer_timeout_s: float) -> None:
    """ClickHouse's ``/ping`` answers ``Ok.``; raise if it does not within the time-outs."""
    address = f"[{host}]" if ":" in host else host  # an IPv6 address, bracketed in the URL
    try:
        answer = request("GET", f"{scheme}://{address}:{port}/ping", timeout_s=answer_timeout_s,
                         connect_timeout_s=connect_timeout_s)
    except TimeoutError:
        raise TimeoutError(f"no answer within {connect_timeout_s:g} s (connect) / {answer_timeout_s:g} s (answer)") \
            from None
    if answer.status != 200:
        raise OSError(f"/ping answered HTTP {answer.status}")


@contextlib.contextmanager
def _chdb_output_held() -> Iterator[None]:
    """chDB's engine writes its errors (``Code: 76. DB::Exception: Cannot lock file …``) to file
    descriptor 2 itself, before raising the same error: hold that text while the database opens, so the
    command's one line says it, and log it on the ``chdb`` logger (shown with --debug or --verbose)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            text = held.read().decode("utf-8", "replace").strip()
            if text:
                logging.getLogger("chdb").debug("%s", text)


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
