"""hvd_compress.torch.waiting: the exchange's wait polls with growing sleeps, not
Horovod's spinning ``sched_yield`` loop (which, on shared cores, slowed the dense
exchange 11-65x: docs/results/adam-era.md, "Waiting")."""

import pytest

from hvd_compress.torch import waiting
from tests.launches import TORCH_GLOO

TORCH_GLOO.add(__name__, "waiting", "tests.workers.torch_waiting:results_and_cpu", {"late_s": 0.3})
TORCH_GLOO.add(__name__, "all_workers", "tests.workers.torch_waiting:examples_all_workers",
               {"late_s": 0.3})


class FakeClock:
    """A clock that only the naps and the yields move (a yield costs ``yield_s``)."""

    def __init__(self, yield_s=1e-6):
        self.t, self.yield_s, self.naps, self.yields = 0.0, yield_s, [], 0

    def __call__(self):
        return self.t

    def nap(self, s):
        self.naps.append(s)
        self.t += s

    def yield_(self):
        self.yields += 1
        self.t += self.yield_s


@pytest.mark.parametrize("ready_at", [0.0, 5e-5, 3e-4, 0.02, 2.0])
def test_until_done_spins_briefly_then_naps_a_share_of_the_wait(ready_at):
    clock = FakeClock()
    waiting.until_done(lambda: clock.t >= ready_at, clock=clock, nap=clock.nap,
                       yield_=clock.yield_)
    assert clock.t >= ready_at
    # yields only within the spin, naps only after it, none before a collective that is done
    assert clock.yields * clock.yield_s <= waiting.SPIN_S + clock.yield_s
    if ready_at == 0.0:
        assert clock.yields == 0 and clock.naps == []
    if ready_at <= waiting.SPIN_S:
        assert clock.naps == []
    # every nap within its bounds, growing with the wait; the overshoot at most one nap
    assert all(waiting.MIN_NAP_S <= s <= waiting.MAX_NAP_S for s in clock.naps)
    assert clock.naps == sorted(clock.naps)
    assert clock.t - ready_at <= max(waiting.MIN_NAP_S, min(waiting.MAX_NAP_S,
                                                            waiting.NAP_SHARE * clock.t)) + 1e-9
    if ready_at >= 1.0:  # long waits poll about once a millisecond, not thousands of times
        assert len(clock.naps) <= ready_at / waiting.MAX_NAP_S + 200


def test_the_wait_mode_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("HVD_COMPRESS_WAIT", raising=False)
    assert not waiting.spins()
    monkeypatch.setenv("HVD_COMPRESS_WAIT", "Spin")
    assert waiting.spins()
    monkeypatch.setenv("HVD_COMPRESS_WAIT", "busy")
    with pytest.raises(ValueError, match="HVD_COMPRESS_WAIT"):
        waiting.spins()


@pytest.mark.multiprocess
def test_both_waits_give_horovods_results_and_the_nap_leaves_the_cpu(request):
    ranks = TORCH_GLOO.results(request, "waiting")
    for mode in ("nap", "spin"):
        for r, got in enumerate(ranks):
            g = got[mode]
            assert g["sum"] == [3.0 * i for i in range(6)]
            assert g["rows"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
            assert g["part"] == [[0.0, 2.0], [4.0, 6.0]][r]
            assert g["late"] == [2.0, 2.0, 2.0]
    nap, spin = ranks[0]["nap"], ranks[0]["spin"]
    assert nap["wall_s"] > 0.2 and spin["wall_s"] > 0.2  # rank 0 did wait for rank 1
    # napping: the waiting thread is off the CPU nearly all the time (Horovod's spin keeps it
    # on as much as the scheduler lets it: often most of the wait; not asserted, it depends
    # on how busy the machine's other cores are)
    assert nap["cpu_s"] < 0.1 * nap["wall_s"], nap


@pytest.mark.multiprocess
def test_the_examples_barrier_waits_for_the_last_worker_without_spinning(request):
    """Timed before an evaluation, it makes the training time the slowest worker's; its
    wait naps, so a waiting worker leaves the shared cores to the ones still training
    (Horovod's ``hvd.barrier`` spins: three spinning workers starved the fourth's DiLoCo
    steps for seconds, docs/results/adam-era.md)."""
    first = TORCH_GLOO.results(request, "all_workers")[0]
    assert first["wall_s"] > 0.2, first  # rank 0 waited for rank 1
    assert first["cpu_s"] < 0.1 * first["wall_s"], first
