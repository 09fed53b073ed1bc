"""execd's log lines: the few calls of ``logging`` it uses, without the module.

``logging`` (with ``traceback``, ``string``, ``weakref`` and the rest it imports) costs
every sandbox 0.8 MiB of resident memory, for a daemon that writes a handful of line
shapes to stderr. Same API for what execd calls (``getLogger(name).info(fmt, *args)``
and friends, ``exception`` with the traceback) and the same line format as the
``logging.basicConfig`` it replaces: ``<asctime> <LEVEL> <name>: <message>``.
"""

from __future__ import annotations

import sys
import threading
import time

TYPE_CHECKING = False  # no typing at run time (see execd/__init__.py)
if TYPE_CHECKING:
    from typing import Any, Dict, Optional, TextIO

LEVELS = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "ERROR": 40}
_NAMES = {v: k for k, v in LEVELS.items()}


class _Config:
    level = LEVELS["WARNING"]  # as logging's root logger before it is configured
    stream: Optional[TextIO] = None  # None: sys.stderr at the time of writing
    lock = threading.Lock()


class Logger:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def _emit(self, level: int, msg: str, args: Any, exc: bool = False) -> None:
        if level < _Config.level:
            return
        try:
            text = msg % args if args else msg
        except (TypeError, ValueError):
            text = "%s %r" % (msg, args)
        now = time.time()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
        line = "%s,%03d %s %s: %s\n" % (stamp, int(now % 1 * 1000), _NAMES[level], self.name, text)
        if exc:
            import traceback  # only when there is a traceback to print

            line += traceback.format_exc()
        stream = _Config.stream or sys.stderr
        with _Config.lock:
            try:
                stream.write(line)
                stream.flush()
            except (OSError, ValueError):
                pass  # a closed stderr must not take a request down with it

    def debug(self, msg: str, *args: Any) -> None:
        self._emit(10, msg, args)

    def info(self, msg: str, *args: Any) -> None:
        self._emit(20, msg, args)

    def warning(self, msg: str, *args: Any) -> None:
        self._emit(30, msg, args)

    def error(self, msg: str, *args: Any) -> None:
        self._emit(40, msg, args)

    def exception(self, msg: str, *args: Any) -> None:
        self._emit(40, msg, args, exc=True)


_loggers: Dict[str, Logger] = {}


def getLogger(name: str) -> Logger:  # noqa: N802 (the name logging gives it)
    return _loggers.setdefault(name, Logger(name))


def configure(level: str, stream: Optional[TextIO] = None) -> None:
    """``level``: one of LEVELS' names."""
    _Config.level = LEVELS[level]
    _Config.stream = stream
