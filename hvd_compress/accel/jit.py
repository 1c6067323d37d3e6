"""The numba decorators every kernel module compiles with (importing this imports numba).

``parallel``: a kernel over a whole tensor, its outer loop split over threads
(``prange``), no fast-math (the kernels keep the reference's float32 arithmetic and
order), NumPy's error model, compiled once and cached on disk -- and, for calls whose
arrays all have fewer than :data:`SERIAL_BELOW` elements, the same code compiled
without threads (``prange`` runs as ``range``), on the first such call.  Waking the
thread pool costs more than a small call's work, and milliseconds where several
processes share the cores (see :data:`SERIAL_BELOW`).  The kernels' threads take
independent stretches fixed by the sizes, never by the thread count, so both give the
same bits -- except the float64 sums of ``sign_sums``, ``abs_sum`` and ``moments``,
which on any pool already depend on the thread count: the serial one gives what one
thread gives.  ``inline``: a helper inlined into the kernels that call it.  numba keys
a kernel's disk cache on its file and qualified name only (not on ``parallel``), so the
serial compilation is of a copy of the function named ``<name>__serial``, and a kernel
module keeps the helpers it inlines in the same file.
"""

from __future__ import annotations

import functools
import os
import types

from numba import njit, prange

__all__ = ["parallel", "inline", "prange", "Kernel", "SERIAL_BELOW"]

#: Calls whose arrays (inputs and outputs) all have fewer elements than this run the
#: serial compilation.  Measured on a 2-core machine shared with other jobs (load 4-12;
#: numba 0.68, OpenMP layer, 2 threads), per call of the 1-bit pack and TernGrad's
#: moments at 1e2, 1e3, 1e4, 3e4, 1e5 values: called back to back (the pool's threads
#: still spinning) the serial one takes 1.1-4.3 us at 1e2-1e3 against 3.1-6.2 us for
#: the pool, ties at 1e4, and is 1.5-1.9x slower at 1e5 (97 vs 61 us); called 3 ms apart
#: (the pool asleep, as between a step's tensors), the pool takes 9-50 ms a call at every
#: one of those sizes, the serial one 15-150 us -- 27-116 ms against 23-150 us with 4
#: such processes at once.  2**16 keeps the pool where it pays on an idle machine and
#: takes the small calls (two-phase chunks, biases, small layers) off it.
#: ``HVD_COMPRESS_SERIAL_BELOW`` sets it at import (0: the pool for every call).
SERIAL_BELOW = int(os.environ.get("HVD_COMPRESS_SERIAL_BELOW", 1 << 16))

_OPTIONS = dict(nogil=True, cache=True, fastmath=False, error_model="numpy")


def _copy_named(fn, suffix):
    """A copy of ``fn`` (same code, globals and file) whose qualified name ends in
    ``suffix``: its own entry in numba's disk cache."""
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + suffix,
                              fn.__defaults__, fn.__closure__)
    copy.__qualname__ = fn.__qualname__ + suffix
    copy.__module__ = fn.__module__
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


class Kernel:
    """A kernel compiled twice: ``parallel`` (threads over the outer ``prange``) and,
    on the first small call, ``serial``; a call runs the serial one when every array
    argument has fewer than :data:`SERIAL_BELOW` elements."""

    def __init__(self, fn):
        functools.update_wrapper(self, fn)
        self.py_func = fn
        self.parallel = njit(parallel=True, **_OPTIONS)(fn)
        self._serial = None

    @property
    def serial(self):
        """The serial compilation (made on first use; from numba's disk cache after)."""
        if self._serial is None:
            self._serial = njit(**_OPTIONS)(_copy_named(self.py_func, "__serial"))
        return self._serial

    def __call__(self, *args):
        below = SERIAL_BELOW
        for a in args:
            if getattr(a, "size", 0) >= below:
                return self.parallel(*args)
        return (self._serial or self.serial)(*args)

    def __repr__(self):
        return f"<Kernel {self.py_func.__module__}.{self.py_func.__qualname__}>"


def parallel(fn):
    """``fn`` as a :class:`Kernel`: threads on big arrays, none on small ones."""
    return Kernel(fn)


inline = njit(nogil=True, cache=True, inline="always")
