"""execd: the command and file daemon that runs inside every sandbox.

It is mounted read-only into unmodified task images and started as the
container command, so it is stdlib-only, Python 3.8+, and never writes next to
itself: the flag below stops Python from caching bytecode for every module
imported after this one (the package's own ``__init__`` is compiled before any
code can run; a real read-only mount makes that write fail silently).
"""

import sys

sys.dont_write_bytecode = True

__version__ = "0.1.0"
