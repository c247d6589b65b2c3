"""Credentials kvtrace is handed (database URLs, webhook URLs and headers): where else than a command
line they can come from, and how they look in messages, which never show them whole.

A command line is visible to every user of the machine (``ps``), so each credential can also come
from the environment or a file: ``KVTRACE_CLICKHOUSE_URL`` / ``KVTRACE_CLICKHOUSE_URL_FILE``
(``--db-file``), and in an alert rules file ``{env: NAME}`` or ``{file: PATH}`` for a webhook's URL
and header values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping
from urllib.parse import urlsplit

from kvtrace.errors import ConfigError

MAX_SECRET_FILE_BYTES = 64 * 1024
"""A credential file is a line or a few; anything longer is the wrong file."""


def without_password(url: str) -> str:
    """A database URL as messages show it: the password masked, the rest (user, host, database) kept."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=f"{parts.username or ''}:***@{host}").geturl()


def redacted_url(url: str) -> str:
    """An endpoint URL (webhook, Alertmanager) as messages show it: scheme, host and port only; the
    user info, path and query (where such URLs carry their tokens) become ``…``."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "(a malformed URL)"
    hidden = parts.username is not None or parts.path not in ("", "/") or parts.query or parts.fragment
    return f"{parts.scheme}://{host}{port}" + ("/…" if hidden else "")


def read_secret_file(path: str | Path, what: str) -> str:
    """The credential in ``path`` (its text without the surrounding white space); ``what`` names it in
    the error (ConfigError, exit code 2) when the file cannot be read."""
    try:
        if not Path(path).is_file():  # a FIFO would block the read; a directory cannot be one
            raise ConfigError(f"{what}: {path} is not a readable regular file")
        with open(path, "rb") as file:
            data = file.read(MAX_SECRET_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {path} ({exc.strerror or exc})") from None
    if len(data) > MAX_SECRET_FILE_BYTES:
        raise ConfigError(f"{what}: {path} is larger than {MAX_SECRET_FILE_BYTES} bytes; name the file that "
                          "holds only the credential")
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ConfigError(f"{what}: {path} is not UTF-8 text") from None
    if not text:
        raise ConfigError(f"{what}: {path} is empty")
    return text


def read_secret_env(environ: Mapping[str, str], name: str, what: str) -> str:
    """The credential in environment variable ``name``; a ConfigError naming it (never its value) if unset."""
    value = (environ.get(name) or "").strip()
    if not value:
        raise ConfigError(f"{what}: environment variable {name} is not set")
    return value
