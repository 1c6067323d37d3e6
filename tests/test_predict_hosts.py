"""The cost model fitted to runs on real hosts (hvd_compress.tools.predict): uncapped runs
whose rows state the rate between the hosts (``link_bandwidth``, compare's
``--hosts-bandwidth``) are fitted and validated at that rate."""

import math

from hvd_compress.tools import costmodel
from hvd_compress.tools import predict as predictions
from hvd_compress.tools.costmodel import Link


def test_runs_on_hosts_are_fitted_at_the_stated_rate():
    links = {costmodel.ALLREDUCE: Link(50e-6, 0.9), costmodel.ALLGATHER: Link(50e-6, 0.8)}
    specs = {"none": (8e7, 0.150, 0.0), "fp16": (4e7, 0.250, 30.0), "topk:ratio=0.01": (1.6e6, 0.004, 300.0)}
    rows = []
    for spec, (nbytes, offset, codec_ms) in specs.items():
        coll = predictions._collective(spec)
        for np_ in (4, 8):  # 2 hosts, then 4, of 2 workers each
            wait = max(0.0, offset + links[coll].comm_s(coll, np_, nbytes, 1e10, 1.0, 2)) * 1e3
            step = 120.0 + codec_ms + wait
            rows.append({"framework": "torch", "example": "synthetic", "compression": spec, "np": str(np_),
                         "nodes": str(np_ // 2), "link_bandwidth": "10gbit", "bandwidth": "uncapped",
                         "latency": "", "status": "ok", "bytes_per_step": str(nbytes), "compute_ms": "120",
                         "encode_ms": str(codec_ms / 2), "decode_ms": str(codec_ms / 2),
                         "comm_ms": str(wait), "step_ms": str(step),
                         "images_per_sec_per_worker": str(8 / (step / 1e3))})
    assert predictions.rate_label(rows[0]) == "10gbit" and predictions._rate(rows[0]) == 1e10
    assert predictions._sample(rows[0]).bandwidth_bps == 1e10
    md, say = predictions.predict(rows)
    assert "predicted 6 capped runs" in say[0] and "6/6 within 25%" in say[0], say
    assert "| `none` | 4 | 10gbit |" in md
    assert "allreduce: alpha = 0.05 ms per message step, eta = 0.900" in md  # fitted, not fixed
    assert "`none` +150.0" in md and "`fp16` +250.0" in md
    # a row without the stated rate stays uncapped
    plain = dict(rows[0], link_bandwidth="")
    assert predictions.rate_label(plain) == "uncapped" and math.isinf(predictions._rate(plain))
