"""argparse types for the CLI's values: counts, finite numbers, turn pairs, comma lists, input files, output
files.

A bad value is refused while the command line is parsed — a one-line
``argument --x: ...`` error and exit code 2 — before anything runs, so a
typo never costs an experiment's worth of work and never ends in a
traceback.
"""

from __future__ import annotations

import argparse
import math
import os
import stat
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit


def count(text: str) -> int:
    """A whole number >= 1 (episodes, tokens, requests...)."""
    value = _whole(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def whole_number(text: str) -> int:
    """A whole number >= 0 (a bound where 0 means none at all)."""
    value = _whole(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 0")
    return value


def seed(text: str) -> int:
    """A random seed: a whole number from 0 to 2**32 - 1 (what numpy and llama.cpp take)."""
    value = _whole(text)
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"{text!r} is not a seed from 0 to {2**32 - 1}")
    return value


def positive_number(text: str) -> float:
    """A finite number > 0 (seconds)."""
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number > 0")
    return value


def share(text: str) -> float:
    """A number in (0, 1] (a sampling rate)."""
    value = _finite(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a share: write a number above 0 and at most 1, e.g. 0.01")
    return value


def non_negative_number(text: str) -> float:
    """A finite number >= 0 (a margin in logits)."""
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number >= 0")
    return value


def turn_pair(text: str) -> tuple[int, int]:
    """``A,B``: two turn numbers (whole numbers from 0 to 2**31 - 1, what a turn is stored as)."""
    parts = text.split(",")
    try:
        turns = tuple(_whole(part.strip()) for part in parts)
    except argparse.ArgumentTypeError:
        turns = ()
    if len(turns) != 2 or not all(0 <= t < 2**31 for t in turns):
        raise argparse.ArgumentTypeError(f"{text!r} is not two turn numbers A,B (whole numbers >= 0), e.g. 0,1")
    return turns[0], turns[1]


def comma_list(text: str) -> tuple[str, ...]:
    """``a,b,c``: the items between commas, stripped, empty ones left out."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


def comma_list_of(parse: Callable[[str], Any]) -> Callable[[str], tuple]:
    """A :func:`comma_list` whose items are each ``parse``'d; its ValueError is the refusal."""
    def parse_all(text: str) -> tuple:
        try:
            return tuple(parse(item) for item in comma_list(text))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse_all


def input_file(text: str) -> Path:
    """A regular file that can be read: not a directory, and not a FIFO or device that would block or never end."""
    path = Path(text)
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        raise argparse.ArgumentTypeError(f"{text}: not a regular file")
    try:
        with path.open("rb") as handle:
            handle.read(1)  # some files (/proc, broken mounts) only fail when read
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text}: cannot be read ({exc.strerror or exc})") from None
    return path


def model_path(text: str) -> Path:
    """A model: a GGUF file (``input_file``) or a model directory (vLLM's: one that holds a config.json)."""
    path = Path(text)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise argparse.ArgumentTypeError(f"{text}: a directory without config.json, not a model directory")
        return path
    return input_file(text)


def output_file(text: str) -> Path:
    """A file path the command will be able to write (its directories are created as needed).

    Checked by opening it for appending, the one test root cannot pass by
    ignoring permission bits; a file that did not exist is removed again.
    """
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a directory; give a file name")
    if path.is_fifo():  # opening it to write would wait for a reader
        raise argparse.ArgumentTypeError(f"{text}: is a FIFO; give a file name")
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text}: cannot be written ({exc.strerror or exc})") from None
    if not existed:
        path.unlink()
    return path


def http_url(text: str) -> str:
    """An http:// or https:// URL with a host (a server to talk to), without a trailing slash."""
    try:
        parts = urlsplit(text)
        parts.port  # a port that is not a number raises here
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http(s)://host[:port] URL")
    return text.rstrip("/")


def upstream_url(text: str) -> str:
    """An :func:`http_url` to send every request to: a base URL without credentials, query or fragment."""
    url = http_url(text)
    parts = urlsplit(url)
    if parts.username is not None or parts.password is not None:
        raise argparse.ArgumentTypeError("give the URL without user:password@ (credentials would show in errors "
                                         "and spans); the proxy does not log in to the upstream")
    if parts.query or parts.fragment:
        raise argparse.ArgumentTypeError(f"{text!r}: give a base URL without ?query or #fragment")
    return url


def listen_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (or ``:PORT`` / ``PORT`` for 127.0.0.1) to listen on; port 0 picks a free one."""
    host, _, port_text = text.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        port = int(port_text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT") from None
    if not 0 <= port < 65536:
        raise argparse.ArgumentTypeError(f"{text!r}: the port must be from 0 to 65535")
    return host, port


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value
