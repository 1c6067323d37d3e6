"""The numba decorators every kernel module compiles with (importing this imports numba).

``parallel``: a kernel over a whole tensor, its outer loop split over threads
(``prange``), no fast-math (the kernels keep the reference's float32 arithmetic and
order), NumPy's error model, compiled once and cached on disk.  ``inline``: a helper
inlined into the kernels that call it.  numba keys a kernel's disk cache on its own
file only, so a kernel module keeps the helpers it inlines in the same file.
"""

from numba import njit, prange

__all__ = ["parallel", "inline", "prange"]

parallel = njit(parallel=True, nogil=True, cache=True, fastmath=False, error_model="numpy")
inline = njit(nogil=True, cache=True, inline="always")
