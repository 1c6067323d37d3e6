"""Compatibility: the numba kernels live in :mod:`hvd_compress.accel` (by family,
gathered in :mod:`hvd_compress.accel.kernels`).  Importing this imports numba."""

from .accel.host import numba_available, requested

AVAILABLE = numba_available()

if AVAILABLE:
    from .accel.kernels import *  # noqa: F401,F403
    from .accel.kernels import __all__ as _KERNELS
else:  # pragma: no cover - numba is installed by scripts/setup.sh
    _KERNELS = []

__all__ = ["AVAILABLE", "requested", "enabled", *_KERNELS]


def enabled() -> bool:
    """Whether the kernels are installed and not turned off."""
    return AVAILABLE and requested()
