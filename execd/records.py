"""``typing.NamedTuple`` at run time without importing ``typing``.

``typing`` (with what it pulls in) costs every sandbox about 0.6 MiB of resident
memory, and execd needed it at run time only for the class form of
``NamedTuple``. Modules declare their records as usual and import this name in the
``else`` of ``if TYPE_CHECKING:``, so mypy checks them against typing's own. The class
built here is a ``collections.namedtuple`` with the annotated fields in order, their
defaults, the docstring and any methods of the class body: what typing's builds too,
minus the ``__annotations__`` nothing in execd reads.
"""

from __future__ import annotations

import collections

TYPE_CHECKING = False  # no typing at run time (see execd/__init__.py)
if TYPE_CHECKING:
    from typing import Any, Dict, Tuple

_OWN = frozenset({"__annotations__", "__module__", "__qualname__", "__doc__"})


class _Builder(type):
    def __new__(mcls, name: str, bases: Tuple[type, ...], ns: Dict[str, Any]) -> Any:
        fields = list(ns.get("__annotations__", {}))
        defaults = [ns[f] for f in fields if f in ns]
        if defaults and any(f not in ns for f in fields[len(fields) - len(defaults) :]):
            raise TypeError("%s: a field without a default follows one with it" % name)
        make = collections.namedtuple  # called with names mypy cannot see: not a literal
        cls = make(name, fields, defaults=defaults, module=ns.get("__module__"))
        cls.__qualname__ = ns.get("__qualname__", name)
        if ns.get("__doc__"):
            cls.__doc__ = ns["__doc__"]
        for key, value in ns.items():
            if key not in _OWN and key not in fields:
                setattr(cls, key, value)
        return cls


# The base a record names: subclassing it hands the class body to ``_Builder``.
NamedTuple = type.__new__(_Builder, "NamedTuple", (), {"__module__": __name__})
