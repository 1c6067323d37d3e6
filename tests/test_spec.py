"""Spec parsing: defaults from the papers, compositions, and the documented errors."""

import pytest

from hvd_compress import spec


def test_defaults_from_papers():
    dgc = spec.parse("dgc").parts[0]
    assert dgc.params["ratio"] == 0.001
    assert dgc.params["sample_ratio"] == 0.01
    assert dgc.params["warmup_epochs"] == 4
    assert dgc.params["momentum"] == 0.9
    q = spec.parse("qsgd").parts[0].params
    assert q["bucket"] == 512 and q["ef"] is False
    assert spec.parse("terngrad").parts[0].params["clip"] == 2.5
    assert spec.parse("terngrad").parts[0].params["ef"] is False
    assert spec.parse("topk").parts[0].params["ef"] is True
    assert spec.parse("onebit").parts[0].params["ef"] is True
    assert spec.parse("threshold").parts[0].params["ef"] is True
    assert spec.parse("powersgd").parts[0].params["rank"] == 2


def test_error_feedback_is_switchable_and_follows_bias():
    assert spec.parse("randomk").parts[0].params["ef"] is True
    assert spec.parse("randomk:unbiased=true").parts[0].params["ef"] is False
    assert spec.parse("randomk:unbiased=true,ef=true").parts[0].params["ef"] is True
    assert spec.parse("qsgd:ef=1").parts[0].params["ef"] is True
    assert spec.parse("topk:ef=off").parts[0].params["ef"] is False


def test_examples_from_the_design_parse():
    for text in ["none", "fp16", "bf16", "topk:ratio=0.01", "randomk:ratio=0.01",
                 "dgc:ratio=0.001", "qsgd:levels=16,bucket=512", "terngrad", "onebit",
                 "threshold:tau=0.01", "powersgd:rank=2", "topk:ratio=0.01+qsgd:levels=16"]:
        parsed = spec.parse(text)
        assert spec.parse(str(parsed)) == parsed


def test_composition():
    s = spec.parse(" TopK:ratio=0.01 + qsgd:levels=16 ")
    assert s.composed and s.name == "topk+qsgd"
    assert s.parts[0].params["ratio"] == 0.01 and s.parts[1].params["levels"] == 16


@pytest.mark.parametrize("text, message", [
    ("topk:ratio=1.5", "topk: ratio must be in (0, 1], got 1.5"),
    ("topk:ratio=0", "topk: ratio must be in (0, 1], got 0"),
    ("topk:ratio=abc", "topk: ratio must be a number, got 'abc'"),
    ("topk:k=3", "topk: unknown parameter 'k'; allowed: ratio, ef"),
    ("zip", "unknown compressor 'zip'"),
    ("qsgd:levels=0", "qsgd: levels must be >= 1, got 0"),
    ("qsgd:levels=2.5", "qsgd: levels must be an integer, got '2.5'"),
    ("dgc:momentum=1", "dgc: momentum must be in [0, 1), got 1"),
    ("threshold:tau=-1", "threshold: tau must be > 0, got -1"),
    ("topk:ef=maybe", "topk: ef must be a boolean, got 'maybe'"),
    ("topk:ratio", "topk: expected key=value, got 'ratio'"),
    ("topk:ratio=0.1,ratio=0.2", "given twice"),
    ("qsgd+topk", "first part of a composition must be a sparsifier"),
    ("topk+randomk", "second part of a composition must be a quantizer"),
    ("topk+qsgd+fp16", "a composition has two parts"),
    ("", "empty compressor spec"),
])
def test_bad_specs_raise_value_error_naming_the_part(text, message):
    with pytest.raises(ValueError) as info:
        spec.parse(text)
    assert message in str(info.value)


def test_non_string_spec_is_a_type_error():
    with pytest.raises(TypeError):
        spec.parse(0.01)


def test_describe_lists_every_compressor():
    text = spec.describe()
    for name in spec.NAMES:
        assert name in text


def test_the_public_module_is_the_core_grammar():
    """The grammar lives in the core (hvd_compress.core.spec); hvd_compress.spec is the same
    functions and classes under the public name, with the registry's names read when asked."""
    from hvd_compress.core import registry
    from hvd_compress.core import spec as core_spec
    assert (spec.parse, spec.describe, spec.Spec, spec.CompressorSpec) == (
        core_spec.parse, core_spec.describe, core_spec.Spec, core_spec.CompressorSpec)
    assert spec.NAMES == core_spec.NAMES == tuple(a.name for a in registry.algorithms())
    assert "qsgd" in spec.QUANTIZERS and "topk" in spec.SPARSIFIERS
    with pytest.raises(AttributeError):
        spec.NOT_A_NAME
