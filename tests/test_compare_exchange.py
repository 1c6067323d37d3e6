"""compare's --exchange modes (issue 38): each compressor that gathers runs with each
exchange asked for, the examples told by --exchange, summable specs once; the
hierarchical ones need --nodes; rows keep the exchange and the wire bytes."""

from pathlib import Path

import pytest

from hvd_compress.tools import compare as cmp
from hvd_compress.tools.runrow import COLUMNS, RunRow


def _plan(*extra):
    args = cmp.parser().parse_args(["--out", "/tmp/never", "--compression", "none",
                                    "topk:ratio=0.01", "terngrad:sum=int", "--np", "1", "4",
                                    "--bandwidth", "200mbit", *extra])
    return args, cmp.plan_runs(args, capped_ok=True)


def test_exchange_modes_and_their_flags():
    args, runs = _plan("--nodes", "2", "--exchange", "two-phase", "hierarchical+two-phase",
                       "auto")
    got = {(r["compression"], r["mode"]) for r in runs if r["np"] == 4}
    assert got == {("none", "sync"), ("none", "auto"),
                   ("topk:ratio=0.01", "sync"), ("topk:ratio=0.01", "flat"),
                   ("topk:ratio=0.01", "two-phase"), ("topk:ratio=0.01", "hierarchical+two-phase"),
                   ("topk:ratio=0.01", "auto"),
                   ("terngrad:sum=int", "sync"), ("terngrad:sum=int", "flat"),
                   ("terngrad:sum=int", "hierarchical+two-phase"), ("terngrad:sum=int", "auto")}
    assert not [r for r in runs if r["np"] == 1 and r["mode"] != "sync"]
    for r in runs:
        cmd = cmp.example_command(args, r, Path("r.json"))
        flag = cmd[cmd.index("--exchange") + 1] if "--exchange" in cmd else None
        want = {"sync": "hierarchical" if r["np"] == 4 else None, "flat": "allgather"}.get(
            r["mode"], r["mode"])
        assert flag == want, (r["mode"], cmd)
    assert cmp.method(next(r for r in runs if r["mode"] == "two-phase")) == \
        "topk:ratio=0.01 (two-phase)"
    _, flat = _plan("--exchange", "two-phase")
    assert {r["mode"] for r in flat if r["compression"] == "topk:ratio=0.01" and r["np"] == 4} \
        == {"sync", "two-phase"}


def test_hierarchical_exchanges_need_nodes(capsys):
    with pytest.raises(SystemExit) as err:
        cmp.main(["--out", "/tmp/never", "--exchange", "hierarchical", "--np", "4"])
    assert err.value.code == 2
    assert "needs --nodes 2 or more" in capsys.readouterr().err


def test_rows_keep_the_exchange_and_the_wire_bytes():
    at = COLUMNS.index("exchange")
    assert COLUMNS[at:at + 3] == ["exchange", "wire_in_per_step", "wire_out_per_step"]
    row = RunRow.of({"compression": "topk:ratio=0.01", "exchange": "two-phase",
                     "wire_in_per_step": 123, "wire_out_per_step": 120})
    assert (row.exchange, row.wire_in_per_step) == ("two-phase", 123)
