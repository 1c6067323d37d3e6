"""The kernels' two compilations (hvd_compress/accel/jit.py): small calls run the serial
one, big calls the thread pool, and both give the reference chain's bits on either side
of the size threshold."""

import zlib

import numba
import numpy as np
import pytest

from hvd_compress.accel import host, jit
from hvd_compress.core import NUMPY
from tests.test_kernels import SPECS, _run

pytestmark = pytest.mark.skipif(not host.numba_available(), reason="numba is not installed")
kernels = host.numba_kernels()
ALL_SERIAL, ALL_PARALLEL = 1 << 62, 0  # SERIAL_BELOW forcing one compilation for every call


def _force(monkeypatch, below):
    monkeypatch.setattr(jit, "SERIAL_BELOW", below)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("n", [1001, jit.SERIAL_BELOW - 1, jit.SERIAL_BELOW + 9])
def test_serial_and_parallel_compilations_give_the_chains_bits(spec, n, monkeypatch):
    rng = np.random.default_rng(zlib.crc32(repr((spec, n, "serial")).encode()))
    xs = [(rng.standard_normal(n) * 1e-2).astype(np.float32) for _ in range(2)]
    noises = [rng.random(n, dtype=np.float32) for _ in range(2)]
    got = {}
    for name, below in [("serial", ALL_SERIAL), ("parallel", ALL_PARALLEL),
                        ("by size", jit.SERIAL_BELOW)]:
        _force(monkeypatch, below)
        got[name] = _run(spec, NUMPY, xs, noises, True, monkeypatch)
    plain = _run(spec, NUMPY, xs, noises, False, monkeypatch)
    for name, (payloads, state) in got.items():
        assert payloads == plain[0], name
        for key in plain[1]:
            np.testing.assert_array_equal(state[key], plain[1][key], err_msg=f"{name}: {key}")


def test_the_size_of_the_largest_array_picks_the_compilation(monkeypatch):
    k = kernels.onebit_pack
    calls = []
    real_parallel, real_serial = k.parallel, k.serial
    monkeypatch.setattr(k, "parallel", lambda *a: calls.append("parallel") or real_parallel(*a))
    monkeypatch.setattr(k, "_serial", lambda *a: calls.append("serial") or real_serial(*a))
    for n in (8, jit.SERIAL_BELOW - 8, jit.SERIAL_BELOW, 8 * jit.SERIAL_BELOW):
        v = np.ones(n, np.float32)
        k(v, np.float32(1), np.float32(-1), np.empty((n + 7) // 8, np.uint8), False)
    assert calls == ["serial", "serial", "parallel", "parallel"]
    # an output of SERIAL_BELOW elements counts as much as an input (decoders)
    out = np.empty(jit.SERIAL_BELOW, np.float32)
    kernels.bit_decode(np.zeros(jit.SERIAL_BELOW // 8, np.uint8), np.ones(2, np.float32), out)
    assert kernels.bit_decode.parallel.signatures and out.min() == 1.0


def test_the_serial_compilation_has_its_own_disk_cache_entry():
    k = kernels.moments
    assert k.serial.py_func.__qualname__ == k.py_func.__qualname__ + "__serial"
    assert k.serial.py_func.__code__ is k.py_func.__code__
    assert k.parallel.targetoptions.get("parallel") and not k.serial.targetoptions.get("parallel")


@pytest.mark.parametrize("name", ["moments", "sign_sums", "abs_sum"])
@pytest.mark.parametrize("n", [7, 1001, 70001])
def test_float64_sums_serially_are_one_threads_sums(name, n):
    """The three float64 reductions split their sum over the pool's threads (their last
    bits depend on the thread count on any pool); serially they are one thread's."""
    v = (np.random.default_rng(n).standard_normal(n) * 1e-2).astype(np.float32)
    k = getattr(kernels, name)
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        one_thread = k.parallel(v)
    finally:
        numba.set_num_threads(before)
    assert np.asarray(k.serial(v)).tobytes() == np.asarray(one_thread).tobytes()
