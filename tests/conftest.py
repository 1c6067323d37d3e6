"""One rule for the whole suite: Horovod is initialised in the pytest process for at most
one framework.

Each framework's Horovod is its own library with its own MPI controller.  The first one
initialised calls ``MPI_Init`` and, at exit, ``MPI_Finalize``; if it shuts down while the
other's background loop still runs, that loop's next collective aborts the process
("MPI_BAND is not defined on MPI_LONG_LONG_INT ... on a NULL communicator") and pytest
exits with status 1 after every test passed.  Tests that need TensorFlow's Horovod
initialised run it under a launch (tests.harness.run_horovod); this fixture fails the
test that breaks the rule, instead of the exit code of the whole run.
"""

import sys

import pytest


def _initialised():
    out = []
    for name in ("horovod.torch", "horovod.tensorflow"):
        module = sys.modules.get(name)
        if module is not None and module.is_initialized():
            out.append(name)
    return out


@pytest.fixture(autouse=True)
def one_horovod_in_process():
    yield
    both = _initialised()
    if len(both) > 1:
        pytest.fail(f"{' and '.join(both)} are both initialised in the pytest process: at exit "
                    "one finalises MPI under the other and the run aborts (tests/conftest.py); "
                    "run this test's Horovod part under tests.harness.run_horovod")


@pytest.fixture
def one_numba_thread():
    """numba's kernels on one thread for the test.  The statistical tests call the host
    fast paths thousands of times on tensors of a few dozen values; on this 2-core machine
    each call of a parallel kernel on a 2-thread pool costs milliseconds of wake-up
    (profiled: 300 TernGrad draws of 48 values, 5-7 s on two threads, 0.08 s on one), the
    same kernels and the same values (tests/test_kernels.py checks them on every core)."""
    try:
        import numba
    except ImportError:  # no numba: no fast paths, nothing to set
        yield
        return
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        yield
    finally:
        numba.set_num_threads(before)
