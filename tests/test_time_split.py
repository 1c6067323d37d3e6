"""Issue 37: a run's encode / comm / decode split is measured or says it was not:
null in the summary, blank in results.csv, ``n/m`` in results.md -- never 0.0."""

import json

from hvd_compress.tools import compare, runtools

SPLIT = ("encode_ms", "comm_ms", "decode_ms")


def _doc(stats):
    return runtools.summary("tensorflow", "train_digits", "none", 2, 10, 320, 0.5, stats, 0.9, 1.0)


def test_summary_of_an_unmeasured_split_is_null_and_compute_the_whole_step():
    doc = _doc({"bytes_sent": 1000})
    assert [doc[k] for k in SPLIT] == [None] * 3
    assert doc["step_ms"] == 50.0 and doc["compute_ms"] == 50.0
    json.dumps(doc)  # (null in JSON)


def test_summary_of_a_measured_split_is_per_step_and_compute_the_rest():
    doc = _doc({"bytes_sent": 1000, "encode_ms": 20.0, "comm_ms": 100.0, "decode_ms": 10.0})
    assert [doc[k] for k in SPLIT] == [2.0, 10.0, 1.0]
    assert doc["step_ms"] == 50.0 and doc["compute_ms"] == 37.0
    # a measured zero stays a zero: the run timed it (the torch wrapper's none decodes nothing)
    assert _doc({"encode_ms": 0.0, "comm_ms": 5.0, "decode_ms": 0.0})["decode_ms"] == 0.0


def _row(doc, **more):
    """The results.csv row compare makes of a run's summary, as read back."""
    row = {"framework": doc["framework"], "example": doc["example"], "compression": "none",
           "np": "2", "bandwidth": "uncapped", "latency": "", "status": "ok", "log": "x",
           "wall_s": "1", **more}
    for key in compare.COLUMNS:
        if key in doc and key not in row:
            row[key] = "" if doc[key] is None else str(doc[key])
    return row


def test_results_md_says_not_measured_never_zero(tmp_path):
    unmeasured = _row(_doc({"bytes_sent": 1000}))
    measured = _row(_doc({"bytes_sent": 1000, "encode_ms": 20.0, "comm_ms": 100.0,
                          "decode_ms": 10.0}), compression="fp16")
    compare.write_csv(tmp_path / "results.csv", [unmeasured, measured])
    rows = compare.read_csv(tmp_path / "results.csv")
    assert [rows[0][k] for k in SPLIT] == ["", "", ""]
    compare.write_markdown(tmp_path / "results.md", rows)
    table = [line for line in (tmp_path / "results.md").read_text().splitlines()
             if line.startswith("| ")]
    head = [c.strip() for c in table[0].strip("|").split("|")]
    cells = {}
    for line in table[1:]:  # (the rule line starts "|-")
        row = dict(zip(head, (c.strip() for c in line.strip("|").split("|"))))
        cells[row["compression"]] = row
    columns = ("encode ms", "comm ms", "decode ms")
    assert [cells["`none`"][c] for c in columns] == ["n/m"] * 3
    assert cells["`none`"]["compute ms"] == "50.0"
    assert [cells["`fp16`"][c] for c in columns] == ["2.0", "10.0", "1.0"]
