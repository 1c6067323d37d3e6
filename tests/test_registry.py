"""What the registry answers about a spec without building it (or, where the class cannot
say, from a fresh compressor): summable, passes through, owns momentum, chained rounds."""

import pytest

from hvd_compress.core import build, registry
from tests.test_core_properties import ALL_SPECS

#: every catalogue spec, the integer sums and DGC's dense form: the forms a flag may differ in
SPECS = ALL_SPECS + ["qsgd:sum=int", "terngrad:sum=int", "signsgd:sum=int",
                     "signsgd:sum=int,vote=false", "dgc:dense=true", "dgc:ratio=0.01+onebit"]


def test_summable_is_the_compressors_answer_for_every_spec():
    for spec in SPECS:
        assert registry.summable(spec) == build(spec).summable, spec


def test_an_algorithms_summable_is_its_answer_at_the_default_parameters():
    """Top-k, Random-k and DGC define ``summable`` as a property of the instance (it depends
    on the parameters): read on the class it was a property object, always true."""
    for alg in registry.algorithms():
        assert alg.summable == build(alg.name).summable, alg.name
    assert not registry.get("topk").summable
    assert not registry.get("dgc").summable
    assert registry.get("randomk").summable
    assert not registry.get("qsgd").summable and registry.get("powersgd").summable


@pytest.mark.parametrize("spec, summable", [
    ("dgc:dense=true", True), ("dgc", False), ("randomk+fp16", True), ("randomk+qsgd", False),
    ("topk+fp16", False), ("qsgd:sum=int", True), ("qsgd", False), ("signsgd:sum=int", True),
])
def test_summable_follows_the_parameters(spec, summable):
    assert registry.summable(spec) is summable


def test_flags_name_the_algorithms_that_need_them():
    """Each flag holds for the algorithms the wrappers and tools once recognised by name, in
    every form (compositions, integer sums, DGC's dense form)."""
    for spec in SPECS:
        first = spec.split("+")[0].split(":")[0]
        assert registry.passes_through(spec) == (spec == "none"), spec
        assert registry.core_of(spec).owns_momentum == (first == "dgc"), spec
        assert registry.chains_rounds(spec) == (first == "powersgd"), spec
        assert registry.chains_rounds(spec) == build(spec).chained_rounds, spec


def test_integer_sums_take_two_rounds_that_are_not_chained():
    """``sum=int`` also takes two rounds, but the first only shares a scale (a max): the
    exchange may stay in flight, which DGA needs."""
    from hvd_compress.core.base import TensorMeta
    meta = TensorMeta("w", (64, 64), "float32")
    for spec in ("qsgd:sum=int", "terngrad:sum=int", "signsgd:sum=int"):
        assert build(spec).rounds(meta) == 2 and not registry.chains_rounds(spec)
    assert build("powersgd:rank=1").rounds(meta) == 2 and registry.chains_rounds("powersgd:rank=1")
