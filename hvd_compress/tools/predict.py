"""The cost model (:mod:`.costmodel`) fitted to a comparison's runs: ``prediction.md``
with the fit, its validation on capped runs it was not fitted on, predicted images/s at
other bandwidths and worker counts (and in clusters of nodes), the crossover
bandwidths and, with a target accuracy, the predicted time to it.  Each run counts with
its exchange (allreduce, allgather, two-phase, hierarchical, hierarchical+two-phase:
:func:`exchange_of`); a compressor whose payloads are gathered also gets two-phase rows
derived from its allgather runs where its two-phase ones were not measured."""

from __future__ import annotations

import dataclasses
import math

from ..core import exchangecost as xc
from ..core.base import TensorMeta
from . import chunkcost, costmodel, netcap
from .plan import EXCHANGE_MODES, FLAT, SYNC, UNCAPPED, mode_of, nodes_of, specs_of, takes_hierarchy
from .report import add_targets, curve_of, number, ok_rows


def _collective(spec: str) -> str:
    from ..core import build
    summable = all(build(s).summable for s in specs_of(spec))
    return costmodel.ALLREDUCE if summable else costmodel.ALLGATHER


#: a tensor larger than any low-rank approximation's break-even: its rounds are the most a
#: compressor's exchange takes
_LARGE_MATRIX = TensorMeta("large", (1 << 16, 1 << 16), "float32")


def _messages(spec: str) -> float:
    """Latency-bound messages per step: Horovod fuses a step's tensors into one
    collective per cycle, so one per round of the exchange (PowerSGD and integer sums:
    two), not one per tensor."""
    from ..core import build
    return float(max((build(s).rounds(_LARGE_MATRIX) for s in specs_of(spec)), default=1))


def _lane_m(spec: str) -> int:
    """The largest integer code when every tensor's codes are summed as integers (the lane
    width then grows with the worker count), else 0."""
    from ..core import build
    comps = [build(s) for s in specs_of(spec)]
    return max(c.m for c in comps) if comps and all(c.integer_sum for c in comps) else 0


def rate_label(r: dict) -> str:
    """A row's link for the cost model: its cap, or, on real hosts (uncapped), the rate
    stated between them (``link_bandwidth``: ``--hosts-bandwidth``); else ``uncapped``."""
    if r["bandwidth"] == UNCAPPED and r.get("link_bandwidth"):
        return netcap.format_rate(netcap.parse_rate(str(r["link_bandwidth"])))
    return r["bandwidth"]


def _rate(r: dict) -> float:
    label = rate_label(r)
    return math.inf if label == UNCAPPED else netcap.parse_rate(label)


def exchange_of(r: dict) -> str:
    """A row's exchange (:mod:`hvd_compress.core.exchangecost`'s names): its ``exchange``
    column, or, in rows written before it, hierarchical where the run took the hierarchy
    (in simulated nodes; the wrapper says ``hierarchical`` for ``none`` too, whose tensors
    go flat), else what the compressor's payloads take (allreduce or allgather)."""
    named = str(r.get("exchange") or "")
    if named in xc.EXCHANGES:
        own = _collective(r["compression"])
        tiered = nodes_of(r) > 1 and takes_hierarchy(r["compression"])
        if xc.is_hierarchical(named) and not tiered:  # the hierarchy asked for, not run
            return own if own == xc.ALLREDUCE else xc.flat_of(named)
        if own == xc.ALLREDUCE and not tiered:  # summed payloads: one allreduce
            return xc.ALLREDUCE
        return named
    if nodes_of(r) > 1 and str(r.get("hierarchical", "")).lower() in ("true", "1") and \
            takes_hierarchy(r["compression"]):
        return xc.HIERARCHICAL
    return _collective(r["compression"])


def hierarchical_row(r: dict) -> bool:
    """Whether a run's compressed tensors took a hierarchical exchange (:func:`exchange_of`)."""
    return xc.is_hierarchical(exchange_of(r))


def two_phase_row(r: dict) -> bool:
    return exchange_of(r) in (xc.TWO_PHASE, xc.HIERARCHICAL_TWO_PHASE)


#: how prediction.md names a compressor's exchanges other than its own flat one
HIER_MARK, TWO_PHASE_MARK = " (hierarchical)", " (two-phase)"
HIER_TWO_PHASE_MARK = " (hierarchical+two-phase)"
MARKS = {xc.HIERARCHICAL: HIER_MARK, xc.TWO_PHASE: TWO_PHASE_MARK,
         xc.HIERARCHICAL_TWO_PHASE: HIER_TWO_PHASE_MARK}


def variant(r: dict) -> str:
    """A row's exchange for the cost model: its compression, marked when not its flat one."""
    return r["compression"] + MARKS.get(exchange_of(r), "")


def group_of(r: dict) -> str:
    """The fit's group (one offset each): the compressor; its two-phase runs (flat or
    hierarchical) a group of their own, fitted with the allgather's link."""
    return r["compression"] + (TWO_PHASE_MARK if two_phase_row(r) else "")


def _row_collective(r: dict) -> str:
    return costmodel.TWO_PHASE if two_phase_row(r) else _collective(r["compression"])


def _per_node(r: dict) -> int:
    return int(r["np"]) // nodes_of(r) if nodes_of(r) > 1 else 1


def _payload(r: dict) -> float:
    """The payload a worker sends per step (hierarchical: its shard's), the cost model's
    ``nbytes``: ``bytes_per_step``, the account's ``bytes_sent`` (the two-phase exchange's:
    its chunks for the other owners and its owner's chunk, about one tensor's payload);
    the bytes over its links (``wire_out``/``wire_in``) the model counts from it."""
    return number(r, "bytes_per_step") or 0.0


def _sample(r: dict) -> costmodel.Sample:
    return costmodel.Sample(_row_collective(r), int(r["np"]), _payload(r),
                            _rate(r), _messages(r["compression"]), (number(r, "comm_ms") or 0.0) / 1e3,
                            group_of(r), (number(r, "step_ms") or 0.0) / 1e3, _per_node(r),
                            hierarchical_row(r), number(r, "local_bytes_per_step") or 0.0)


#: per-message-step latency assumed when the runs cannot tell it (one worker count):
#: a switched Ethernet hop with Gloo's software on top
DEFAULT_ALPHA_US = 50.0


def _fixed_alpha(rows: list[dict], alpha_us: float | None) -> float | None:
    """The alpha to fix (seconds), or None to fit it: it can be fitted only from runs at
    two or more worker counts above one."""
    if alpha_us is not None:
        return alpha_us * 1e-6
    counts = {int(r["np"]) for r in rows if int(r["np"]) > 1 and math.isfinite(_rate(r))}
    return None if len(counts) >= 2 else DEFAULT_ALPHA_US * 1e-6


def _fit(rows: list[dict], alpha_s: float | None = None):
    """Links and per-compressor offsets (:func:`costmodel.fit_model`) from runs with
    more than one worker, uncapped ones included (they pin the offsets)."""
    return costmodel.fit_model([_sample(r) for r in rows if int(r["np"]) > 1], alpha_s)


def _predict_step(fitted, base: costmodel.Profile, r: dict) -> float:
    links, offsets = fitted
    prof = dataclasses.replace(base, comm_offset_ms=1e3 * offsets.get(group_of(r), 0.0))
    return costmodel.StepModel(links, {"x": prof}).step_ms("x", int(r["np"]), _rate(r), _per_node(r))


def _dense_bytes(rows: list[dict]) -> float:
    """The float32 gradient's bytes: 4 per parameter where the runs say, else what
    ``none`` sends (0: unknown)."""
    for r in rows:
        if number(r, "parameters"):
            return 4.0 * number(r, "parameters")
    return max([number(r, "bytes_per_step") or 0.0 for r in rows if r["compression"] == "none"], default=0.0)


def _profile(r: dict, dense: float = 0.0) -> costmodel.Profile:
    step = number(r, "step_ms") or 0.0
    tensors = number(r, "tensors_per_step") or 0.0
    gathered = _row_collective(r) != costmodel.ALLREDUCE
    per_chunk = chunkcost.chunk_ms(r["compression"], str(r.get("framework") or "torch")) \
        if tensors and gathered else 0.0
    return costmodel.Profile(group_of(r), _row_collective(r), number(r, "compute_ms") or 0.0,
                             number(r, "encode_ms") or 0.0, number(r, "decode_ms") or 0.0,
                             _payload(r), _messages(r["compression"]),
                             int(r["np"]), (number(r, "images_per_sec_per_worker") or 0.0) * step / 1e3,
                             lane_m=_lane_m(r["compression"]), per_node=_per_node(r),
                             hierarchical=hierarchical_row(r),
                             local_bytes=number(r, "local_bytes_per_step") or 0.0, dense_bytes=dense,
                             tensors=tensors, chunk_ms=per_chunk)


def derived_profiles(profiles: dict) -> dict:
    """The two-phase exchanges of each compressor whose payloads are gathered and whose
    two-phase runs were not measured, flat and (where the gradient's size is known)
    hierarchical: its allgather's profile (the flat one where measured) counted for them
    (:meth:`costmodel.Profile.as_exchange`), with its offset."""
    out = {}
    for key, f in profiles.items():
        comp = f.compression
        if f.collective != costmodel.ALLGATHER or (key != comp and comp in profiles):
            continue
        for mark, hier in ((TWO_PHASE_MARK, False), (HIER_TWO_PHASE_MARK, True)):
            name = comp + mark
            if name in profiles or name in out or (hier and not (f.dense_bytes or f.local_bytes)):
                continue
            out[name] = f.as_exchange(costmodel.TWO_PHASE, hier)
    return out


def time_to_target_lines(rows: list[dict], model, target: float, ps, bws) -> list[str]:
    """prediction.md's time-to-accuracy table: per compressor with a sync run that reached
    ``target``, the epochs it took (measured: the median over its runs that got there)
    times one epoch's images over the predicted images/s at ``p`` workers and bandwidth
    ``B``.  The assumption, stated in the table's heading: the epochs to the target
    depend on the method, not on the link (it changes no arithmetic) nor on the worker
    count (which changes the global batch: a new ``--np`` should be measured once)."""
    epochs, per_epoch = {}, []
    for r in rows:
        if r.get("epochs_to_target") in (None, "") or r["compression"] not in model.profiles:
            continue
        epochs.setdefault(r["compression"], []).append(int(float(r["epochs_to_target"])))
        curve = curve_of(r)
        if curve and number(r, "images_per_sec"):
            per_epoch.append(number(r, "images_per_sec") * curve[-1]["seconds"] / curve[-1]["epoch"])
    if not epochs or not per_epoch:
        return [f"No sync run reached the target accuracy {target:g}: no time to predict.", ""]
    images = sorted(per_epoch)[len(per_epoch) // 2]
    head = ["compression", "epochs to target"] + [f"p={p} {netcap.format_rate(b)}" for p in ps
                                                   for b in bws]
    out = [f"## Predicted time to {target:g} test accuracy (seconds of training)", "",
           "Epochs to the target measured (the median over a compressor's runs that reached "
           f"it), one epoch = {images:,.0f} images, step time predicted. Assumed: the epochs "
           "to the target do not change with the bandwidth (the link changes no arithmetic) "
           "nor with the worker count (which changes the global batch; measure a new np once).",
           "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for spec, got in epochs.items():
        e = sorted(got)[len(got) // 2]
        cells = [f"{e * images / model.images_per_sec(spec, p, b):.1f}" for p in ps for b in bws]
        out.append(f"| `{spec}` | {e} | " + " | ".join(cells) + " |")
    return out + [""]


#: the predictions' nodes: workers per node, and the links inside a node (PCIe 4 x16
#: class; NVLink is several times faster)
DEFAULT_PER_NODE, DEFAULT_LOCAL_BPS = 8, 2e11
#: the node table's worker counts and links between nodes
NODE_PS, NODE_BWS = (8, 64, 256, 1024), (1e10, 2.5e10, 1e11)
#: the links between nodes of the table at the largest worker count (slow ones too)
TARGET_BWS = (1e9, 1e10)


def predict(rows: list[dict], alpha_us: float | None = None, target: float | None = None,
            per_node: int = DEFAULT_PER_NODE, local_bps: float = DEFAULT_LOCAL_BPS,
            ) -> tuple[str, list[str]]:
    """(prediction.md text, lines worth printing).  ``alpha_us``: the per-message-step
    latency to assume (default: fitted when the runs cover two or more worker counts,
    else :data:`DEFAULT_ALPHA_US`).  Only rows of one exchange a step are used (sync, flat
    and the fixed ``--exchange`` modes; not ``auto``, local SGD or DGA).  ``target``: also
    predict the time to that test accuracy (:func:`time_to_target_lines`).  Runs in
    simulated nodes (``--nodes``) count with their exchange (hierarchical or flat,
    :func:`variant`); ``per_node`` and ``local_bps`` set the nodes of the node table
    (:func:`node_lines`)."""
    # one exchange a step: sync, flat and the fixed --exchange modes (auto mixes them)
    rows = [r for r in ok_rows(rows)
            if mode_of(r) in (SYNC, FLAT) or (mode_of(r) in EXCHANGE_MODES and mode_of(r) != "auto")]
    # capped: runs at a known rate (a cap, or real hosts' stated rate), validated; uncapped:
    # runs without a cap (real hosts' too), each compressor's profile
    capped = [r for r in rows if math.isfinite(_rate(r)) and int(r["np"]) > 1 and not r.get("latency")]
    uncapped = [r for r in rows if r["bandwidth"] == UNCAPPED]
    md, say = ["# Cost model", ""], []
    if not uncapped:
        return "# Cost model\n\nNo uncapped run succeeded: nothing to fit.\n", ["predict: no uncapped runs"]
    # per compressor: the uncapped run at the largest worker count stands for a worker's costs
    profiles, at_np = {}, {}
    dense = _dense_bytes(rows)
    for r in sorted(uncapped, key=lambda r: int(r["np"])):
        profiles[variant(r)] = _profile(r, dense)
        at_np[(variant(r), int(r["np"]), nodes_of(r))] = _profile(r, dense)
    multi = [r for r in rows if int(r["np"]) > 1 and not r.get("latency")]
    alpha = _fixed_alpha(capped, alpha_us)
    fitted = _fit(multi, alpha) if multi else ({}, {})
    links, offsets = fitted
    if capped:
        md += [f"Fitted to {len(multi)} run(s) with more than one worker ({len(capped)} capped): "
               + "; ".join(
            f"{coll}: alpha = {lk.alpha_s * 1e3:.2f} ms per message step, eta = {lk.efficiency:.3f} x "
            "the nominal rate" for coll, lk in links.items() if coll in costmodel.LINK_OF.values())
               + " (two-phase: the allgather's)." + (
                "" if alpha is None else f" Alpha is fixed at {alpha * 1e6:.0f} us (the runs cover one "
                "worker count, where alpha times the hops is a constant the offsets take up; "
                "`--alpha-us` sets it for your network, runs at several worker counts fit it)."), "",
            "Per-compressor offsets (ms; what the collective costs besides the link, less what hides "
            "behind the backward pass): " + ", ".join(f"`{k}` {1e3 * v:+.1f}" for k, v in offsets.items()),
            ""]
    else:
        links = {coll: costmodel.Link(alpha_s=0.0, efficiency=1.0)
                 for coll in (costmodel.ALLREDUCE, costmodel.ALLGATHER)}
        md += ["No capped run: the link cannot be fitted; assumed alpha = 0 and the nominal rate "
               "(efficiency 1). Run with `--bandwidth` (as root) for a fitted model.", ""]
    md += ["Step = compute + encode + decode(p) + wait(p, B); wait = max(0, offset + transfer), transfer "
           "by ring allreduce 2(p-1)/p*S*8/(eta*B) + 2(p-1)*alpha per collective or allgather "
           "(p-1)*S*8/(eta*B) + (p-1)*alpha or two-phase (alltoall of chunks to their owners, allgather of "
           "the owners' chunks) 2(p-1)/p*S*8/(eta*B) + 2(p-1)*alpha; allgather decoding grows with p, "
           "two-phase decodes about two tensors. Each compressor's compute, "
           "encode, decode and bytes are its uncapped run at the largest worker count (np "
           f"{max(int(r['np']) for r in uncapped)} here); on this machine workers share the cores, "
           "so compute is that of a worker with a share of them.", ""]

    # validation: each capped run predicted by a fit made without it
    md += ["## Validation on capped runs (leave one out)", ""]
    errors = []
    if len(capped) >= 2:
        md += ["| compression | np | bandwidth | measured step ms | predicted ms | error |",
               "|---|---|---|---|---|---|"]
        for r in capped:
            base = at_np.get((variant(r), int(r["np"]), nodes_of(r)))
            if base is None:
                continue
            pred = _predict_step(_fit([o for o in multi if o is not r], alpha), base, r)
            meas = number(r, "step_ms")
            err = (pred - meas) / meas
            errors.append(abs(err))
            name = f"`{r['compression']}`" + variant(r)[len(r["compression"]):]
            md.append(f"| {name} | {r['np']} | {rate_label(r)} | {meas:.1f} | {pred:.1f} | "
                      f"{100 * err:+.1f}% |")
        if errors:
            within = sum(e <= 0.25 for e in errors)
            line = (f"cost model: predicted {len(errors)} capped runs it was not fitted on; median error "
                    f"{100 * sorted(errors)[len(errors) // 2]:.1f}%, worst {100 * max(errors):.1f}%, "
                    f"{within}/{len(errors)} within 25%")
            md += ["", line, ""]
            say.append(line)
    else:
        md += ["Fewer than two capped runs: nothing to validate on.", ""]
        say.append("cost model: fewer than two capped runs, not validated")

    # validation across bandwidths: fitted without any run at this rate, predict them
    rates = sorted({rate_label(r) for r in capped}, key=netcap.parse_rate)
    if len(rates) >= 2:
        md += ["## Validation across bandwidths (fitted without any run at the predicted rate)", "",
               "| predicted rate | fitted on | runs | median error | worst error | within 25% |",
               "|---|---|---|---|---|---|"]
        for rate in rates:
            test = [r for r in capped if rate_label(r) == rate and
                    (variant(r), int(r["np"]), nodes_of(r)) in at_np]
            if not test:
                continue
            without = _fit([o for o in multi if rate_label(o) != rate], alpha)
            errs = sorted(abs(_predict_step(without, at_np[(variant(r), int(r["np"]), nodes_of(r))], r)
                              - number(r, "step_ms")) / number(r, "step_ms") for r in test)
            within = sum(e <= 0.25 for e in errs)
            others = ", ".join(["uncapped"] + [o for o in rates if o != rate])
            md.append(f"| {rate} | {others} | {len(errs)} | {100 * errs[len(errs) // 2]:.1f}% | "
                      f"{100 * errs[-1]:.1f}% | {within}/{len(errs)} |")
            say.append(f"cost model: {rate} runs predicted without any {rate} run: median error "
                       f"{100 * errs[len(errs) // 2]:.1f}%, worst {100 * errs[-1]:.1f}%, "
                       f"{within}/{len(errs)} within 25%")
        md.append("")

    # predictions
    profiles = {k: dataclasses.replace(v, comm_offset_ms=1e3 * offsets.get(v.compression, 0.0))
                for k, v in profiles.items()}
    derived = derived_profiles(profiles)
    profiles.update(derived)
    model = costmodel.StepModel(links, profiles)
    bws = [1e8, 1e9, 1e10, 1e11]
    ps = [2, 8, 64, 1024]
    md += ["## Predicted images/s (all workers) and speed-up over none", ""]
    head = ["compression"] + [f"p={p} {netcap.format_rate(b)}" for p in ps for b in bws]
    md += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    has_none = "none" in profiles
    # one worker a link: no nodes
    flat = [k for k in profiles if not k.endswith(HIER_MARK) and not k.endswith(HIER_TWO_PHASE_MARK)]
    for spec in flat:
        cells = []
        for p in ps:
            for b in bws:
                ips = model.images_per_sec(spec, p, b)
                rel = ips / model.images_per_sec("none", p, b) if has_none else float("nan")
                cells.append(f"{ips:.0f}" + (f" ({rel:.2f}x)" if has_none else ""))
        mark = " (derived)" if spec in derived else ""
        md.append(f"| `{spec}`{mark} | " + " | ".join(cells) + " |")
    md.append("")
    if has_none:
        md += ["## Crossover bandwidths", ""]
        for spec in flat:
            if spec == "none":
                continue
            for p in ps:
                kind, bps = costmodel.crossover(model, spec, p)
                if kind == "below":
                    text = f"{spec} beats none below {bps / 1e9:.3g} Gbit/s at {p} workers"
                elif kind == "above":
                    text = f"{spec} beats none above {bps / 1e9:.3g} Gbit/s at {p} workers"
                elif kind == "always":
                    text = f"{spec} beats none at every bandwidth from 1 Mbit/s to 1 Tbit/s at {p} workers"
                else:
                    text = f"{spec} never beats none between 1 Mbit/s and 1 Tbit/s at {p} workers"
                md.append(f"- {text}")
                if p == 8 and spec not in derived:
                    say.append(text)
        md.append("")
    if has_none:
        got, lines = node_lines(model, per_node, local_bps, set(derived))
        md += got
        say += lines
    if target is not None:
        md += time_to_target_lines(add_targets([dict(r) for r in rows], target), model, target,
                                   ps, bws)
    return "\n".join(md), say


def node_lines(model: costmodel.StepModel, per_node: int, local_bps: float,
               derived=frozenset()) -> tuple[list[str], list[str]]:
    """prediction.md's tables for clusters of nodes: predicted images/s (and the speed-up
    over ``none``) of every exchange, at :data:`NODE_PS` workers in nodes of ``per_node``
    and :data:`NODE_BWS` between nodes, the best per column; at the largest count, the
    speed-ups at :data:`TARGET_BWS` and the bytes of a step; the worker counts
    (``per_node`` times powers of 2, to 1,024 nodes) at which each beats ``none``.
    ``derived``: the profiles not measured (:func:`derived_profiles`), marked.
    (Lines for prediction.md, lines worth printing.)"""
    L = per_node
    scan = [L * 2 ** k for k in range(11)]
    specs = list(model.profiles)

    def ips(spec, p, b):
        return model.images_per_sec(spec, p, b, L, local_bps)

    def label(spec):
        return f"`{spec}`" + (" (derived)" if spec in derived else "")

    head = ["exchange"] + [f"p={p} {netcap.format_rate(b)}" for p in NODE_PS for b in NODE_BWS]
    md = [f"## Nodes of {L}: predicted images/s (all workers) and speed-up over none", "",
          f"{L} workers a node, the links inside a node at {netcap.format_rate(local_bps)} "
          f"(`--local-bandwidth`), the node's link to the others at the rate in the column; at "
          f"p = {L} the job is one node and every collective runs inside it. The hierarchical "
          "exchange (dense inside the node, compressed between nodes) and the flat one are rows "
          "of their own where measured; a worker's compute, encode and decode are as measured, "
          "encode and decode scaled to the shard a worker holds (1/L of a tensor, hierarchical) "
          "and to the payloads it decodes. Two-phase rows marked (derived) were not measured: "
          "the compressor's allgather run counted for the two-phase exchange (its alltoall of "
          "chunks to their owners and allgather of the owners' chunks: 2(p-1)/p of the payload "
          "each way a worker, 2(p-1) message steps, about two tensors decoded), its offset kept.",
          "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    best = {}
    for spec in specs:
        cells = []
        for p in NODE_PS:
            for b in NODE_BWS:
                v, base = ips(spec, p, b), ips("none", p, b)
                cells.append(f"{v:.0f} ({v / base:.2f}x)")
                if (p, b) not in best or v > best[(p, b)][1]:
                    best[(p, b)] = (spec, v, v / base)
        md.append(f"| {label(spec)} | " + " | ".join(cells) + " |")
    md.append("| **best** | " + " | ".join(f"`{best[(p, b)][0]}` ({best[(p, b)][2]:.2f}x)"
                                          for p in NODE_PS for b in NODE_BWS) + " |")
    P = NODE_PS[-1]
    md += ["", f"### At {P:,} workers: slow links between nodes, and the bytes of a step", "",
           "Bytes over a worker's links per step, out and in, as its account counts them (MB, the "
           "account's `wire_out` / `wire_in`; flat: with every worker, hierarchical: with its cross "
           "set), what the node's link to the others carries in its busier direction, and the dense "
           "bytes a worker sends inside its node.", "",
           "| exchange | " + " | ".join(f"{netcap.format_rate(b)}" for b in TARGET_BWS)
           + " | sent MB | received MB | node link MB | inside the node MB |",
           "|---|" + "---|" * (len(TARGET_BWS) + 4)]
    top = {}
    for spec in specs:
        cells = []
        for b in TARGET_BWS:
            v = ips(spec, P, b) / ips("none", P, b)
            cells.append(f"{v:.2f}x")
            if b not in top or v > top[b][1]:
                top[b] = (spec, v)
        t = model.profiles[spec].traffic_at(P, L)
        cells += [f"{x / 1e6:.3g}" for x in (t.sent, t.received, t.wire, t.local_bytes)]
        md.append(f"| {label(spec)} | " + " | ".join(cells) + " |")
    md.append("| **best** | " + " | ".join(f"`{top[b][0]}` ({top[b][1]:.2f}x)" for b in TARGET_BWS)
              + " | | | | |")
    md += ["", f"### Worker counts at which each beats none (nodes of {L}, {L} to {scan[-1]:,} workers)",
           "", "| exchange | " + " | ".join(netcap.format_rate(b) for b in NODE_BWS) + " |",
           "|---|" + "---|" * len(NODE_BWS)]
    say = []
    for spec in specs:
        if spec == "none":
            continue
        cells = []
        for b in NODE_BWS:
            wins = [p for p in scan if ips(spec, p, b) > ips("none", p, b)]
            if not wins:
                cells.append("never")
                continue
            stop = next((p for p in scan if p > wins[0] and p not in wins), None)
            cells.append(f"from {wins[0]:,}" + (f", stops at {stop:,}" if stop else
                                                f", still at {scan[-1]:,}"))
        md.append(f"| {label(spec)} | " + " | ".join(cells) + " |")
        if spec not in derived:
            say.append(f"nodes of {L}, {netcap.format_rate(NODE_BWS[0])}: {spec} beats none "
                       + cells[0].replace("never", "at no worker count"))
    p, b = NODE_PS[-1], NODE_BWS[0]
    say.append(f"nodes of {L}: best at {p} workers and {netcap.format_rate(b)}: "
               f"{best[(p, b)][0]} ({best[(p, b)][2]:.2f}x none)")
    say += [f"nodes of {L}: best at {P} workers and {netcap.format_rate(b)}: {top[b][0]} "
            f"({top[b][1]:.2f}x none)" for b in TARGET_BWS if b not in NODE_BWS]
    return md + [""], say
