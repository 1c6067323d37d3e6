"""Sparse gradients (``nn.Embedding(sparse=True)``) with our optimizer, against Horovod's.

One ``horovodrun -np 2 --gloo`` launch trains the same model in every mode
(tests/workers/torch_sparse.py).  With ``none`` ours must do exactly what
Horovod's optimizer does -- its sparse allreduce, a sparse averaged gradient --
and with ``sparse_as_dense=True`` likewise; with a compressor the gradient is
densified, compressed, and goes back sparse, the ranks in agreement.
"""

import numpy as np
import pytest

from tests.launches import TORCH_GLOO, TORCH_MPI

pytestmark = pytest.mark.multiprocess


_SHARED = {"gloo": TORCH_GLOO, "mpi": TORCH_MPI}  # (with other modules' np 2 bodies: tests.launches)
for _launch in _SHARED.values():
    _launch.add(__name__, "sparse_embeddings", "tests.workers.torch_sparse:sparse_embeddings")


@pytest.fixture(scope="module", params=["gloo", "mpi"])
def runs(request):
    return _SHARED[request.param].results(request, "sparse_embeddings")


def test_none_is_horovods_sparse_allreduce(runs):
    for rank in runs:
        for ours, theirs in zip(rank["ours"]["log"], rank["horovod"]["log"]):
            assert ours["sparse"] and theirs["sparse"]
            assert ours["grad"] == theirs["grad"]
            assert ours["params"] == theirs["params"]
        assert rank["ours"]["warnings"] == []
        assert rank["ours"]["bytes"] > 0
    assert runs[0]["ours"]["log"][-1]["params"] == runs[1]["ours"]["log"][-1]["params"]


def test_sparse_as_dense_is_horovods(runs):
    for rank in runs:
        for ours, theirs in zip(rank["ours-dense"]["log"], rank["horovod-dense"]["log"]):
            assert ours["sparse"] == theirs["sparse"]
            np.testing.assert_allclose(ours["grad"], theirs["grad"], rtol=0, atol=1e-7)
            np.testing.assert_allclose(ours["params"][0], theirs["params"][0], rtol=0, atol=1e-6)


def test_a_compressor_densifies_warns_once_and_ranks_agree(runs):
    for rank in runs:
        topk = rank["ours-topk"]
        assert all(entry["sparse"] for entry in topk["log"])  # back in the sparse p.grad
        assert len(topk["warnings"]) == 1 and "made dense" in topk["warnings"][0]
        grad = np.array(topk["log"][0]["grad"])
        # top-k at 20% of the 240 embedding entries on each of 2 ranks: at most 96 nonzero
        assert 0 < np.count_nonzero(grad) <= 2 * 48
    assert runs[0]["ours-topk"]["log"][-1]["params"] == runs[1]["ours-topk"]["log"][-1]["params"]
