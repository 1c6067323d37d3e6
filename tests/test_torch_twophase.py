"""The two-phase exchange and the exchange chosen by cost in PyTorch, under horovodrun -np 4
(Gloo; one launch): each tensor's average is bit for bit the numpy definition of the
exchange it took, every rank took the same, and the bytes a worker receives stay under
2 C(n) where two-phase runs."""

import pytest

from tests.harness import run_horovod
from tests.workers.torch_twophase import SPECS

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def results():
    return run_horovod("tests.workers.torch_twophase:matches_reference", np=4,
                       env={"HVD_COMPRESS_EXCHANGE": ""})


def _tolerance(spec):
    """Bit for bit, but ``none``: Horovod's own averaging allreduce (its ring's order of
    additions) against the reference's sum then division."""
    return 1e-7 if spec == "none" else 0.0


@pytest.mark.parametrize("spec", SPECS)
def test_two_phase_is_its_definition(results, spec):
    plans = [res["report"][f"{spec}|two-phase"]["plan"] for res in results]
    for res in results:
        r = res["report"][f"{spec}|two-phase"]
        assert r["max_diff"] <= _tolerance(spec), (spec, r["max_diff"], r["worst_at"])
        two = {n for n, (e, _) in r["plan"].items() if e == "two-phase"}
        if spec != "none":  # every tensor that can, goes two-phase; a worker receives < 2 C(n)
            assert two == set(r["can_two_phase"]) and two, (spec, r["plan"])
            for out, got in r["wire"]:
                assert got <= 2 * r["whole"] + 1024, (spec, got, r["whole"])
        assert not r["hierarchical"]
    assert all(p == plans[0] for p in plans)


@pytest.mark.parametrize("spec", SPECS)
def test_auto_is_the_definition_of_what_it_chose_on_every_rank(results, spec):
    plans = [res["report"][f"{spec}|auto"]["plan"] for res in results]
    assert all(p == plans[0] for p in plans)  # every rank chose alike
    for name, (exchange, why) in plans[0].items():
        assert exchange in ("allgather", "allreduce", "two-phase"), (name, exchange)
        assert why.startswith(exchange), why  # the plan says which and why
        if spec == "none":
            assert exchange == "allreduce"
    for res in results:
        r = res["report"][f"{spec}|auto"]
        assert r["max_diff"] <= _tolerance(spec), (spec, r["max_diff"], r["worst_at"])


def test_allreduce_is_refused_for_gathered_payloads(results):
    for res in results:
        assert "needs payloads that add up" in res["report"]["refusal"]


def test_two_phase_under_mpi():
    """The same under Open MPI's controller (Horovod's MPI alltoall and allgather)."""
    specs = ["topk:ratio=0.1", "onebit"]
    results = run_horovod("tests.workers.torch_twophase:matches_reference", np=4,
                          controller="mpi", kwargs={"specs": specs, "steps": 2,
                                                    "exchanges": ["two-phase"]})
    for res in results:
        for spec in specs:
            r = res["report"][f"{spec}|two-phase"]
            assert r["max_diff"] == 0.0, (spec, r["max_diff"], r["worst_at"])
            assert any(e == "two-phase" for e, _ in r["plan"].values())
