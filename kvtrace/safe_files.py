"""Files kvtrace writes are its user's alone; files it reads from a shared directory are taken only
when they are plain files.

What kvtrace writes holds what a request carried (token ids with ``ids`` capture, prompts in
quarantined lines), so it is made private when it is made: directories 0700, files 0600, whatever
the umask, and never written through a symbolic link someone planted where a file was expected.
What it reads from a spool directory may have been put there by anyone who can write to it, so a
read takes a regular file only (never a link, a FIFO or a device) and never more than a stated
number of bytes.  docs/files-and-permissions.md gives the rules and where each file lives.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # opening a FIFO must not wait for its other end
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class NotRegularFile(OSError):
    """A path that is a symbolic link, a FIFO, a device or a directory where a plain file was expected."""


class TooLarge(OSError):
    """A file larger than what its reader takes."""


def private_dir(path: Path, link_ok: bool = True) -> Path:
    """``path`` as a directory, every component this call creates made 0700 (one that exists keeps its mode:
    it is its owner's choice).  ``link_ok=False``: a directory kvtrace keeps inside a shared one (a spool's
    ``stats/``, ``quarantine/``) must not be a symbolic link to somewhere else (``NotRegularFile``)."""
    path = Path(path)
    if not link_ok and _is_link(path):
        raise NotRegularFile(f"{path} is a symbolic link, not a directory of kvtrace's")
    missing, parent = [], path
    while not parent.is_dir() and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, PRIVATE_DIR_MODE)
        except FileExistsError:
            if not directory.is_dir():  # a file, or a link to nowhere, where the directory belongs
                raise
            continue  # made meanwhile by another process
        os.chmod(directory, PRIVATE_DIR_MODE)  # the umask may have taken bits the owner needs
    return path


def create_private(path: Path, flags: int = os.O_WRONLY) -> int:
    """A new file at ``path``, 0600, opened with ``flags``; ``FileExistsError`` when anything is there already
    (a file, or a link planted in its place), so nothing is ever written through a link."""
    return os.open(path, flags | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, PRIVATE_FILE_MODE)


def append_private(path: Path) -> int:
    """``path`` opened for appending, created 0600 when missing.  An existing one must be a regular file of
    this user that is not a link; one from a kvtrace that made it readable to others is made 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _NONBLOCK | _CLOEXEC, PRIVATE_FILE_MODE)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotRegularFile(f"{path} is not a regular file")
        if info.st_uid != os.geteuid():
            raise PermissionError(f"{path} belongs to another user")
        if info.st_mode & 0o077:
            os.fchmod(fd, PRIVATE_FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def replace_private(path: Path, data: bytes) -> None:
    """Write ``data`` as the whole of ``path`` (0600): to a new file of a random name beside it, then renamed
    over it, so a reader sees the old content or the new, and a link at ``path`` is replaced, not followed.
    A missing directory is made (0700)."""
    path = Path(path)
    private_dir(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # 0600, O_EXCL
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def check_writable_dir(directory: Path) -> None:
    """Raise the ``OSError`` that writing a file in ``directory`` would meet (made 0700 if missing): a file of
    a random name is created there and removed."""
    private_dir(directory)
    fd, probe = tempfile.mkstemp(prefix=".kvtrace-probe-", dir=directory)  # dot files are not ingested
    os.close(fd)
    os.unlink(probe)


def open_regular(path: Path) -> BinaryIO:
    """``path`` opened for reading when it is a regular file and not a symbolic link; ``NotRegularFile``
    otherwise (checked on the open file, so it cannot be swapped in between)."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC)
    except OSError:
        if _is_link(path):  # what O_NOFOLLOW refused (ELOOP)
            raise NotRegularFile(f"{path} is a symbolic link") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(f"{path} is {describe_mode(mode)}, not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: Path, limit: int) -> bytes:
    """The bytes of the regular file ``path`` (``open_regular``); ``TooLarge`` when it holds more than ``limit``."""
    with open_regular(path) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise TooLarge(f"{path} holds more than {limit:,} bytes")
    return data


def regular_entries(directory: Path, suffixes: tuple[str, ...],
                    link_ok: bool = True) -> tuple[list[Path], list[tuple[Path, str]]]:
    """The regular files in ``directory`` whose names end in one of ``suffixes`` (dot files left out), sorted;
    and the entries with such names passed over, each with what it is (a link, a FIFO …).  ``OSError``
    when the directory cannot be listed (``NotRegularFile`` when it is a link and ``link_ok`` is false)."""
    if not link_ok and _is_link(directory):
        raise NotRegularFile(f"{directory} is a symbolic link, not a directory of kvtrace's")
    regular, passed_over = [], []
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.startswith(".") or not entry.name.endswith(suffixes):
                continue
            try:
                mode = entry.stat(follow_symlinks=False).st_mode
            except OSError as exc:
                passed_over.append((Path(entry.path), f"cannot be looked at: {exc.strerror or exc}"))
                continue
            if stat.S_ISREG(mode):
                regular.append(Path(entry.path))
            else:
                passed_over.append((Path(entry.path), describe_mode(mode)))
    return sorted(regular), sorted(passed_over)


def describe_mode(mode: int) -> str:
    """What a file of ``mode`` is, in words ("a symbolic link", "a FIFO" …)."""
    for test, words in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
                        (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return words
    return "not a regular file"


def _is_link(path: Path) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return False
