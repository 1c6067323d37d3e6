"""A comparison's results: ``results.csv``, ``results.md`` (speed-ups over ``none``, the
best method per setting, the fastest to a target accuracy -- or, for the language model, to a
target validation loss) and the PNG plots.

Rows are the CSV's (:class:`~hvd_compress.tools.runrow.RunRow`, or dicts of its
columns): every value may be text (a resumed matrix reads them back), so numbers are
read with :func:`number`.
"""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path

from ..core.registry import passes_through
from . import runtools
from .plan import (
    COLUMNS,
    LOSS_EXAMPLES,
    MWMS,
    OPTIMIZERS,
    SYNC,
    device_of,
    method,
    mode_of,
    nodes_of,
    optimizer_of,
    run_key,
    specs_of,
)
from .runrow import RunRow

#: what a curve's points measure: the test accuracy (higher is better; the examples'
#: ``epoch`` points) or the language model's validation loss (lower; ``step`` points)
ACCURACY, LOSS = "test_accuracy", "val_loss"


def read_csv(path: Path) -> list[RunRow]:
    """results.csv's rows, each value its text (a column the file lacks: absent)."""
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return [RunRow.of(r) for r in csv.DictReader(f)]


def write_csv(path: Path, rows: list) -> None:
    """``rows`` (RunRow objects or dicts) as results.csv: :data:`COLUMNS`, a blank cell
    for a column a row lacks or holds as None."""
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for row in rows:
            w.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in COLUMNS})
    os.replace(tmp, path)


def number(row: dict, key: str) -> float | None:
    """A row's ``key`` as a number; None where it is blank, not a number or NaN."""
    try:
        value = float(row.get(key, ""))
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


def ok_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("status") == "ok"]


def _setting(r: dict) -> tuple:
    """Runs compared with each other: same framework, example, np, bandwidth, latency,
    nodes and device."""
    return (r["framework"], r["example"], str(r["np"]), r["bandwidth"], r.get("latency", ""),
            nodes_of(r), device_of(r))


def setting_of(rows: list[dict]):
    """A function giving each of ``rows`` its setting (:func:`_setting`).  TensorFlow's
    strategy (mode TF MWMS, framework tensorflow) joins the setting of the Horovod rows
    beside it whatever their framework: with ``--framework torch --strategy mwms`` the
    baseline trains the same MLP in Keras, and is compared with the torch runs.  Where
    Horovod rows of both frameworks share a setting it stays with tensorflow's."""
    horovod: dict = {}
    for r in rows:
        if mode_of(r) != MWMS:
            horovod.setdefault(_setting(r)[1:], set()).add(r["framework"])

    def key(r: dict) -> tuple:
        s = _setting(r)
        frameworks = horovod.get(s[1:], set())
        if mode_of(r) == MWMS and len(frameworks) == 1:
            return (next(iter(frameworks)),) + s[1:]
        return s
    return key


def is_baseline(r: dict) -> bool:
    """``none`` in sync mode (every tensor sent as Horovod sends it), with the example's first
    optimizer where it has a choice (dense AdamW): what speed-ups and times to target are
    measured against."""
    first = OPTIMIZERS.get(r.get("example"), ("",))[0]
    return mode_of(r) == SYNC and optimizer_of(r) in ("", first) and \
        all(passes_through(s) for s in specs_of(r["compression"]))


def speedups(rows: list[dict]) -> dict:
    """run key -> images/s over that of none in sync mode at the same framework, example,
    np, bandwidth and device."""
    setting = setting_of(rows)
    base = {setting(r): number(r, "images_per_sec") for r in ok_rows(rows) if is_baseline(r)}
    out = {}
    for r in ok_rows(rows):
        b = base.get(setting(r))
        ips = number(r, "images_per_sec")
        if b and ips is not None:
            out[run_key(r)] = ips / b
    return out


def _where(setting: tuple) -> str:
    _, _, np_, bw, lat, nodes, device = setting
    return f"np {np_}" + (f" in {nodes} nodes" if nodes > 1 else "") + f", {bw}" + \
        (f", latency {lat}" if lat else "") + (f", on {device}" if device != "cpu" else "")


def _settings(rows: list[dict], multi_only: bool) -> list[tuple[tuple, list[dict]]]:
    groups: dict = {}
    setting = setting_of(rows)
    for r in ok_rows(rows):
        if int(r["np"]) > 1 or not multi_only:
            groups.setdefault(setting(r), []).append(r)
    return sorted(groups.items(), key=lambda kv: (kv[0][6], kv[0][:2], int(kv[0][2]), kv[0][5],
                                                  str(kv[0][3]), kv[0][4]))


def best_lines(rows: list[dict]) -> list[str]:
    """Per worker count and bandwidth (np > 1): the method (compressor, mode) with the
    most images/s and its speed-up over none in sync mode."""
    sp = speedups(rows)
    lines = []
    for setting, rs in _settings(rows, multi_only=True):
        rs = [r for r in rs if run_key(r) in sp]
        if not rs:
            continue
        best = max(rs, key=lambda r: number(r, "images_per_sec") or 0.0)
        unit = "tokens/s" if best["example"] in LOSS_EXAMPLES else "images/s"
        lines.append(f"best at {_where(setting)}: {method(best)} -- {number(best, 'images_per_sec'):.1f} "
                     f"{unit}, {sp[run_key(best)]:.2f}x none")
    return lines


def curve_of(row: dict, metric: str = ACCURACY) -> list[dict]:
    """A row's accuracy curve (points with epoch, seconds, test_accuracy), in epoch order;
    with ``metric=LOSS`` its validation-loss curve (points with step, seconds, val_loss), in
    step order; [] when it has none (a failed run, an example without that metric)."""
    raw = row.get(runtools.CURVE)
    if not raw:
        return []
    points = json.loads(raw) if isinstance(raw, str) else raw
    return sorted((p for p in points if p.get(metric) is not None),
                  key=lambda p: p.get("epoch", p.get("step", 0)))


def reach(curve: list[dict], target: float, metric: str = ACCURACY) -> dict | None:
    """The first point of ``curve`` whose test accuracy is at or above ``target`` (a loss:
    at or below it); None: the run never got there."""
    if metric == LOSS:
        return next((p for p in curve if p[LOSS] <= target), None)
    return next((p for p in curve if p[ACCURACY] >= target), None)


def check_target(target: float) -> float:
    return runtools.check_accuracy(target, "--target-accuracy")


def best_accuracy(row: dict) -> float | None:
    """The best test accuracy a successful run reached (its curve's, else its final one)."""
    if row.get("status") != "ok":
        return None
    accs = [p["test_accuracy"] for p in curve_of(row)]
    return max(accs) if accs else number(row, "test_accuracy")


def best_loss(row: dict) -> float | None:
    """The lowest validation loss a successful run reached (its curve's, else its last)."""
    if row.get("status") != "ok":
        return None
    losses = [p[LOSS] for p in curve_of(row, LOSS)]
    return min(losses) if losses else number(row, LOSS)


def best_of(row: dict, metric: str = ACCURACY) -> float | None:
    return best_loss(row) if metric == LOSS else best_accuracy(row)


def hit(row: dict, target: float, metric: str = ACCURACY) -> dict | None:
    """The curve point at which a successful run first reached ``target`` (None: never)."""
    return reach(curve_of(row, metric), target, metric) if row.get("status") == "ok" else None


def missed(row: dict, target: float, metric: str = ACCURACY) -> bool:
    """Whether a successful run with a curve of ``metric`` never reached ``target``."""
    return row.get("status") == "ok" and bool(curve_of(row, metric)) and hit(row, target, metric) is None


def add_targets(rows: list[dict], target: float | None, metric: str = ACCURACY) -> list[dict]:
    """Fill each row's ``best_accuracy`` (and ``best_loss`` where it has a loss curve) and,
    with a target, ``target_accuracy`` (``metric=LOSS``: ``target_loss``),
    ``time_to_target_s`` and ``epochs_to_target`` (a loss: ``steps_to_target``; blank where
    the run never reached it) from its curve; returns ``rows``.  Recomputed from the curves
    every time, so a resumed matrix may change its target."""
    for r in rows:
        best = best_accuracy(r)
        point = hit(r, target, metric) if target is not None else None
        r["best_accuracy"] = "" if best is None else best
        if curve_of(r, LOSS) or r.get("best_loss") is not None:
            r["best_loss"] = "" if best_loss(r) is None else best_loss(r)
        loss = metric == LOSS
        r["target_accuracy"] = "" if target is None or loss else target
        r["time_to_target_s"] = point["seconds"] if point else ""
        r["epochs_to_target"] = point.get("epoch", "") if point else ""
        if loss or r.get("target_loss") is not None:
            r["target_loss"] = "" if target is None or not loss else target
            r["steps_to_target"] = point.get("step", "") if point else ""
    return rows


def _when(point: dict) -> str:
    """How far a run had trained at a curve point: its epochs, or its steps."""
    return f"{point['epoch']} epoch(s)" if "epoch" in point else f"{point['step']} step(s)"


def target_lines(rows: list[dict], target: float, metric: str = ACCURACY) -> list[str]:
    """Per worker count and bandwidth: the method that reached ``target`` soonest, and
    how much sooner than none in sync mode; or that no run reached it."""
    lines = []
    what = "validation loss" if metric == LOSS else "accuracy"
    for setting, rs in _settings(rows, multi_only=False):
        curved = [r for r in rs if curve_of(r, metric)]
        if not curved:
            continue
        reached = [(hit(r, target, metric), r) for r in curved if hit(r, target, metric) is not None]
        if not reached:
            top = min(curved, key=lambda r: best_loss(r)) if metric == LOSS else \
                max(curved, key=lambda r: best_accuracy(r) or 0.0)
            lines.append(f"no run reached {target:g} at {_where(setting)}; the best {what} was "
                         f"{method(top)}'s {best_of(top, metric):.4f}")
            continue
        point, best = min(reached, key=lambda pr: pr[0]["seconds"])
        line = (f"fastest to {target:g} at {_where(setting)}: {method(best)} -- {point['seconds']:.2f} s, "
                f"{_when(point)}")
        base = next((r for r in curved if is_baseline(r)), None)
        if base is not None and base is not best:
            at = hit(base, target, metric)
            name = method(base)
            if at is not None:
                ratio = at["seconds"] / point["seconds"] if point["seconds"] > 0 else math.inf
                line += f", {ratio:.2f}x sooner than {name} ({at['seconds']:.2f} s)"
            else:
                line += f"; {name} missed it (best {best_of(base, metric):.4f})"
        lines.append(line)
    return lines


def write_markdown(path: Path, rows: list[dict], target: float | None = None,
                   stopped: bool = False, metric: str = ACCURACY, note: str = "") -> None:
    """results.md: the table (a mode column when some run is not sync, an optimizer column
    when the example has a choice, a device column when some run is not on the CPU; the
    language model's in tokens/s with its validation loss; with a target, the time and
    epochs (steps) to it, or "missed" and the best accuracy (loss) reached), then the best
    method per setting and, with a target, the fastest to it; ``stopped``: the runs
    ended at the target (``--stop-at-target``), which the heading then says; ``note``: a
    paragraph put first (what the rows are, where they are not single runs)."""
    rows = [RunRow.of(r) for r in rows]
    sp = speedups(rows)
    modes = any(mode_of(r) != SYNC for r in rows)
    on_gpu = any(device_of(r) != "cpu" for r in rows)
    optimizers = any(optimizer_of(r) for r in rows)
    lm = bool(rows) and all(r.example in LOSS_EXAMPLES for r in rows)
    loss = metric == LOSS or lm
    head = (["framework", "example", "compression"] + (["optimizer"] if optimizers else [])
            + (["mode"] if modes else []) + ["np"] + (["device"] if on_gpu else [])
            + ["bandwidth", "tokens/s" if lm else "images/s", "per worker", "vs none", "bytes/step",
               "compute ms", "encode ms", "comm ms", "decode ms", "val loss" if loss else "accuracy"]
            + (["to target s", "steps to target" if metric == LOSS else "epochs to target"]
               if target is not None else []) + ["wall s", "status"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        okay = r.status == "ok"

        def num(key, fmt="{:.1f}"):
            v = number(r, key)
            if okay and v is None and key in runtools.SPLIT_KEYS:
                return "n/m"  # the run did not measure this part of its step (never 0.0)
            return fmt.format(v) if (okay and v is not None) else ""
        s = sp.get(run_key(r))
        bw = r.bandwidth + (f" +{r.latency}" if r.latency else "")
        reached = []
        if target is not None:
            point = hit(r, target, metric)
            if point is not None:
                when = point.get("step" if metric == LOSS else "epoch", "")
                reached = [f"{point['seconds']:.2f}", str(when)]
            elif missed(r, target, metric):
                reached = [f"missed (best {best_of(r, metric):.4f})", ""]
            else:
                reached = ["", ""]
        lines.append("| " + " | ".join(
            [r.framework, r.example, f"`{r.compression}`"] + ([optimizer_of(r)] if optimizers else [])
            + ([mode_of(r)] if modes else []) + [
                str(r.np) + (f" ({nodes_of(r)} nodes)" if nodes_of(r) > 1 else "")] + (
                [device_of(r)] if on_gpu else []) + [bw,
                num("images_per_sec"), num("images_per_sec_per_worker"),
                f"{s:.2f}x" if s is not None else "", num("bytes_per_step", "{:,.0f}"),
                num("compute_ms"), num("encode_ms"), num("comm_ms"), num("decode_ms"),
                num(LOSS if loss else "test_accuracy", "{:.4f}")] + reached + [
                num("wall_s"), "ok" if okay else (r.status or "").split(";")[0]]) + " |")
    text = "\n".join(lines) + "\n"
    if target is not None and metric == LOSS:
        text = (f"Target validation loss {target:g}: time to target is the training time (evaluation "
                "not counted) until the first evaluation whose validation loss was at or below it."
                + (" Every run stopped there (--stop-at-target)." if stopped else "") + "\n\n" + text)
    elif target is not None:
        text = (f"Target test accuracy {target:g}: time to target is the training time (evaluation not "
                "counted) until the end of the first epoch whose test accuracy reached it."
                + (" Every run stopped there (--stop-at-target): its accuracy is that epoch's."
                   if stopped else "") + "\n\n" + text)
    bl = best_lines(rows) + (target_lines(rows, target, metric) if target is not None else [])
    if bl:
        text += "\n" + "\n".join(f"- {line}" for line in bl) + "\n"
    path.write_text((note + "\n\n" if note else "") + text)


def plot(out: Path, rows: list[dict], target: float | None = None, metric: str = ACCURACY) -> list[str]:
    """The PNG plots (with the language model's, loss_curves.png); returns the files written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [RunRow.of(r) for r in ok_rows(rows)]
    if not rows:
        return []
    written = []
    methods = list(dict.fromkeys(method(r) for r in rows))
    bands = list(dict.fromkeys(r.bandwidth for r in rows))

    # throughput against worker count, one panel per bandwidth (np 1 is in every panel)
    fig, axes = plt.subplots(1, len(bands), figsize=(5.5 * len(bands), 4.2), squeeze=False)
    for ax, bw in zip(axes[0], bands):
        for name in methods:
            pts = sorted((int(r.np), number(r, "images_per_sec")) for r in rows
                         if method(r) == name and (r.bandwidth == bw or int(r.np) == 1))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_title(f"links: {bw}")
        ax.set_xlabel("workers (np)")
        ax.set_ylabel("images/s (all workers)")
        ax.set_xticks(sorted({int(r.np) for r in rows}))
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    written.append(_save(fig, out / "throughput.png"))

    # bytes one worker sends per step
    per_spec = {}
    for r in rows:
        if int(r.np) > 1 or method(r) not in per_spec:
            per_spec[method(r)] = number(r, "bytes_per_step") or 0.0
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(per_spec) + 1.5))
    names = list(per_spec)
    ax.barh(names, [max(per_spec[n], 1.0) for n in names], color="tab:blue")
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("bytes sent per step per worker (log)")
    for i, n in enumerate(names):
        ax.text(max(per_spec[n], 1.0), i, f" {per_spec[n] / 1e6:.2f} MB", va="center", fontsize=7)
    fig.tight_layout()
    written.append(_save(fig, out / "bytes_per_step.png"))

    # where the step time goes, stacked, one bar per run
    labels, parts = [], {k: [] for k in ("compute_ms", "encode_ms", "comm_ms", "decode_ms")}
    for r in rows:
        labels.append(f"{method(r)}\nnp{r.np} {r.bandwidth}")
        for k in parts:
            parts[k].append(number(r, k) or 0.0)
    fig, ax = plt.subplots(figsize=(max(8, 0.55 * len(labels)), 5))
    bottom = [0.0] * len(labels)
    for k, color in zip(parts, ("tab:gray", "tab:orange", "tab:red", "tab:green")):
        ax.bar(range(len(labels)), parts[k], bottom=bottom, label=k.replace("_ms", ""), color=color)
        bottom = [b + v for b, v in zip(bottom, parts[k])]
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=90, fontsize=6)
    ax.set_ylabel("ms per step")
    ax.legend()
    fig.tight_layout()
    written.append(_save(fig, out / "time_split.png"))

    acc = [r for r in rows if number(r, "test_accuracy") is not None]
    if acc:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name in methods:
            pts = [(number(r, "wall_s"), number(r, "test_accuracy"), r) for r in acc if method(r) == name]
            if pts:
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], label=name)
                for x, y, r in pts:
                    ax.annotate(f"np{r.np} {r.bandwidth}", (x, y), fontsize=6)
        ax.set_xlabel("wall-clock time of the run (s)")
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(_save(fig, out / "accuracy_vs_time.png"))

    panels = curve_panels(rows)
    if panels:
        written.append(_plot_curves(plt, out / "accuracy_curves.png", panels, methods,
                                    target if metric == ACCURACY else None))
    panels = curve_panels(rows, LOSS)
    if panels:
        written.append(_plot_curves(plt, out / "loss_curves.png", panels, methods,
                                    target if metric == LOSS else None, LOSS))
    return written


def curve_panels(rows: list[dict], metric: str = ACCURACY) -> dict:
    """(np, bandwidth) -> the successful rows with an accuracy curve (a loss curve), in the
    order of accuracy_curves.png's (loss_curves.png's) grid (worker counts down, bandwidths
    across)."""
    panels: dict = {}
    for r in ok_rows(rows):
        if curve_of(r, metric):
            panels.setdefault((int(r["np"]), r["bandwidth"]), []).append(r)
    bands = list(dict.fromkeys(bw for _, bw in panels))
    return {key: panels[key] for key in sorted(panels, key=lambda k: (k[0], bands.index(k[1])))}


def _plot_curves(plt, path: Path, panels: dict, methods: list[str], target: float | None,
                 metric: str = ACCURACY) -> str:
    """Test accuracy (validation loss) against training time, one line per run, one panel per
    np x bandwidth."""
    nps = list(dict.fromkeys(n for n, _ in panels))
    bands = list(dict.fromkeys(bw for _, bw in panels))
    fig, axes = plt.subplots(len(nps), len(bands), figsize=(5.2 * len(bands), 3.8 * len(nps)),
                             squeeze=False, sharey=True)
    colors = plt.get_cmap("tab10" if len(methods) <= 10 else "tab20")
    for i, n in enumerate(nps):
        for j, bw in enumerate(bands):
            ax = axes[i][j]
            if (n, bw) not in panels:
                ax.set_visible(False)
                continue
            for r in panels[(n, bw)]:
                pts = curve_of(r, metric)
                ax.plot([p["seconds"] for p in pts], [p[metric] for p in pts], marker="o",
                        markersize=3, color=colors(methods.index(method(r)) % colors.N), label=method(r))
            if target is not None:
                ax.axhline(target, color="black", linestyle="--", linewidth=0.8, label=f"target {target:g}")
            ax.set_title(f"np {n}, links: {bw}")
            ax.set_xlabel("training time (s)")
            ax.set_ylabel("validation loss" if metric == LOSS else "test accuracy")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6, loc="upper right" if metric == LOSS else "lower right")
    fig.tight_layout()
    return _save(fig, path)


def _save(fig, path: Path) -> str:
    import matplotlib.pyplot as plt
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
