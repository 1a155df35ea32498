"""Work-arounds for bugs in the Qt bindings, applied once before the window opens.

PySide6 6.12 (abi3 wheels) drops one reference too many to objects that Python 3.12
made immortal (``None``, ``True``, ``False``, ...) in many Python-to-C++ calls: every
slot that returns None, ``QObject.property()`` of an unset name, virtual-method
dispatch (a pyqtgraph redraw loses dozens). On Python 3.12+ those objects are immortal
and nothing happens. On Python 3.10/3.11 the reference count of ``None`` (a few
thousand at start) falls by about one per Qt callback until CPython aborts with
"Fatal Python error: none_dealloc" — after a minute or two of streaming with the
telemetry panel open (``bool_dealloc`` for True/False).

These objects are static singletons that are never freed, so their reference counts
carry no meaning except that check. Raising them far out of reach (what Python 3.12
does by making them immortal) makes the bug harmless without touching anything else.
"""

from __future__ import annotations

import ctypes
import sys

# About 2**40 callbacks: more than thirty years at a thousand lost references a second.
_NONE_HEADROOM = 1 << 40
_applied = False


def protect_none_refcount() -> bool:
    """Give None, True, False and the other 3.12-immortal singletons a huge reference count on
    CPython < 3.12 (idempotent); True if it was needed."""
    global _applied
    if _applied or sys.version_info >= (3, 12) or sys.implementation.name != "cpython":
        return False
    singletons = [None, True, False, Ellipsis, NotImplemented, (), "", b"", *range(-5, 257)]
    for obj in singletons:
        # ob_refcnt is the first field of every CPython object (Py_ssize_t).
        ctypes.c_ssize_t.from_address(id(obj)).value += _NONE_HEADROOM
    _applied = True
    return True
