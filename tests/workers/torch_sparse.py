"""Bodies for tests/test_torch_sparse.py: sparse embedding gradients under horovodrun -np 2."""

from __future__ import annotations

import warnings

import torch

MODES = ["horovod", "ours", "horovod-dense", "ours-dense", "ours-topk"]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(40, 6, sparse=True)
        self.fc = torch.nn.Linear(6, 3)

    def forward(self, idx):
        return self.fc(self.emb(idx).mean(1))


def sparse_embeddings(steps=4):
    """Each mode trains the same model from the same start on the same rank-dependent
    batches (with repeated indices); returns per mode the parameters after each step,
    whether the embedding's gradient reached the optimizer sparse, and the warnings."""
    import horovod.torch as hvd

    import hvd_compress.torch as hc
    hvd.init()
    rank = hvd.rank()
    out = {}
    for mode in MODES:
        model = Net()
        base = torch.optim.SGD(model.parameters(), lr=0.5)
        kind, _, spec = mode.partition("-")
        dense = spec == "dense"
        kwargs = {"named_parameters": model.named_parameters(), "sparse_as_dense": dense}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if kind == "horovod":
                opt = hvd.DistributedOptimizer(base, **kwargs)
            else:
                comp = "topk:ratio=0.2" if spec == "topk" else "none"
                opt = hc.DistributedOptimizer(base, compression=comp, **kwargs, min_numel=0)
            log = []
            for step in range(steps):
                g = torch.Generator().manual_seed(100 * step + rank)
                idx = torch.randint(0, 40, (5, 3), generator=g)
                idx[0, 0] = idx[0, 1]  # a repeated index in the batch
                y = torch.randint(0, 3, (5,), generator=g)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(idx), y).backward()
                opt.synchronize()
                sparse = model.emb.weight.grad.is_sparse
                grad = model.emb.weight.grad.to_dense().clone()
                with opt.skip_synchronize():
                    opt.step()
                log.append({"sparse": sparse, "grad": grad.flatten().tolist(),
                            "params": [p.detach().flatten().tolist() for p in model.parameters()]})
        out[mode] = {"log": log, "warnings": [str(w.message) for w in caught
                                              if "sparse" in str(w.message)],
                     "bytes": opt.comm_totals["bytes_sent"] if kind == "ours" else None}
    return out
