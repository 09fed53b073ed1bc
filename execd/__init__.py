"""execd: the command and file daemon that runs inside every sandbox.

It is mounted read-only into unmodified task images and started as the
container command, so it is stdlib-only, Python 3.8+, and never writes next to
itself: the flag below stops Python from caching bytecode for every module
imported after this one (the package's own ``__init__`` is compiled before any
code can run; a real read-only mount makes that write fail silently).

No module imports ``typing`` at run time (0.6 MiB, with what it pulls in, in every
sandbox): each starts with ``from __future__ import annotations`` (annotations stay
strings) and imports its types under ``if TYPE_CHECKING:``, where ``TYPE_CHECKING`` is
a module constant ``False`` (mypy takes any name ``TYPE_CHECKING`` as true; importing
``typing.TYPE_CHECKING`` would import typing). Type aliases live in those blocks too;
``records.NamedTuple`` stands in for typing's at run time.
"""

import sys

sys.dont_write_bytecode = True

__version__ = "0.1.0"
