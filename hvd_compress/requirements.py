"""What the framework wrappers need beyond numpy, checked when they are imported.

``hvd_compress`` and ``hvd_compress.core`` need numpy alone.  ``hvd_compress.torch``
needs PyTorch and Horovod built with PyTorch support; ``hvd_compress.tensorflow``
TensorFlow and Horovod built with TensorFlow support.  Where one is missing, the
import fails with an :class:`ImportError` that names it, the version we test, and
how to install it -- not with the first ``No module named`` deep inside the wrapper.
"""

from __future__ import annotations

import importlib
import importlib.util

#: the Horovod release the test suite runs against (``scripts/setup.sh`` builds it)
HOROVOD_VERSION = "0.28.1"

_FRAMEWORKS = {
    # wrapper: (framework module, its name, pip extra, Horovod module, Horovod's build flag)
    "torch": ("torch", "PyTorch", "torch", "horovod.torch", "HOROVOD_WITH_PYTORCH"),
    "tensorflow": ("tensorflow", "TensorFlow", "tensorflow", "horovod.tensorflow",
                   "HOROVOD_WITH_TENSORFLOW"),
}


def _install_horovod(flag: str) -> str:
    return (f"hvd-compress is tested with Horovod {HOROVOD_VERSION}.  Install it with the "
            "repository's scripts/setup.sh (it builds Horovod with the source fixes today's "
            "PyTorch and TensorFlow need, scripts/horovod_fixes.sh), or into this environment:\n"
            f"    {flag}=1 pip install --no-cache-dir horovod=={HOROVOD_VERSION}")


def _like(error: ImportError) -> type:
    """ModuleNotFoundError where a module is missing (what ``pytest.importorskip`` skips on),
    else ImportError (a module that is there but fails to load)."""
    return ModuleNotFoundError if isinstance(error, ModuleNotFoundError) else ImportError


def require(wrapper: str) -> None:
    """Import the framework and Horovod's module for ``wrapper`` (``"torch"`` or
    ``"tensorflow"``); raise an ImportError saying what is missing and how to get it."""
    module, framework, extra, horovod_module, flag = _FRAMEWORKS[wrapper]
    who = f"hvd_compress.{wrapper}"
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise _like(e)(f"{who} needs {framework} ({module}), which does not import here "
                          f"({e}).  Install it, e.g. pip install \"hvd-compress[{extra}]\".",
                          name=module) from e
    if importlib.util.find_spec("horovod") is None:
        raise ModuleNotFoundError(f"{who} needs Horovod (horovod) built with {framework} support, and "
                          f"Horovod is not installed.  {_install_horovod(flag)}", name="horovod")
    try:
        importlib.import_module(horovod_module)
    except ImportError as e:
        raise _like(e)(f"{who} needs Horovod built with {framework} support, and "
                          f"{horovod_module} does not import ({e}).  {_install_horovod(flag)}",
                          name=horovod_module) from e
