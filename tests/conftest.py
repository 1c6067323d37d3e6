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
