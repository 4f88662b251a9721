"""Opening files that a user or another program may have replaced with something else (issue 32).

A plain ``open`` of a FIFO blocks until a writer comes (a launcher that never returns), a write
through a symbolic link overwrites whatever the link points at, a folder gives IsADirectoryError,
and a file of gigabytes is read into memory. ``open_regular`` opens without blocking
(``O_NONBLOCK``: a FIFO opens at once), optionally without following a final symbolic link
(``O_NOFOLLOW``), and refuses anything but a regular file with ``NotRegular``, whose message says
what the path is instead; ``read_regular`` reads a whole regular file up to a size limit.
"""
from __future__ import annotations

import errno
import os
import stat


class NotRegular(Exception):
    """The path is not a regular file (or is too large); the message says what it is, without the path."""


def kind(mode: int) -> str:
    """What a non-regular file is, in words ("a FIFO (named pipe)", "a folder", ...)."""
    for test, name in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "a special file"


def _link_target(path) -> str:
    try:
        return f" (to {os.readlink(path)})"
    except OSError:
        return ""


def open_regular(path, flags: int = os.O_RDONLY, *, follow: bool = True, mode: int = 0o666) -> int:
    """A descriptor of the regular file ``path`` opened with ``flags`` (``os.O_*``); never blocks on a FIFO.

    ``follow=False`` refuses a final symbolic link (for files ddtrain writes into in place).
    Raises NotRegular naming what the path is instead; other failures are the OSError ``os.open``
    raised (FileNotFoundError for a path that is gone).
    """
    extra = os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (0 if follow else getattr(os, "O_NOFOLLOW", 0))
    try:
        fd = os.open(path, flags | extra, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow and os.path.islink(path):
            raise NotRegular(f"is a symbolic link{_link_target(path)}, not a regular file") from None
        if exc.errno == errno.EISDIR:
            raise NotRegular("is a folder, not a regular file") from None
        if exc.errno == errno.ENXIO:   # O_WRONLY|O_NONBLOCK on a FIFO nobody reads, or a socket
            try:
                what = kind(os.stat(path).st_mode)
            except OSError:
                what = "a special file"
            raise NotRegular(f"is {what}, not a regular file") from None
        raise
    try:
        info = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise NotRegular(f"is {kind(info.st_mode)}, not a regular file")
    return fd


def read_regular(path, limit: int) -> bytes:
    """The bytes of the regular file ``path``; NotRegular when it is something else or larger than ``limit`` bytes."""
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise NotRegular(f"is larger than {limit:,} bytes, too large for what it should be")
    return data
