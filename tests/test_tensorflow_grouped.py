"""HorovodTF's allreduces (eager and traced): held until the exchange waits, then run as
one ``hvd.grouped_allreduce`` per op, scales and dtype where that keeps each element's
bits (any maximum, integer sums; float sums over two ranks only), compared with each
allreduce run alone, bit for bit."""

import pytest

from tests.launches import TF_GLOO, TF_GLOO3
from tests.workers.tf_grouped import CASES

pytestmark = pytest.mark.multiprocess


# traced at np 3 the float sums go one by one into Horovod's own fusion, which orders an
# element's terms by the timing of the cycle: no fixed bits to compare with
TARGET = "tests.workers.tf_grouped:grouped_matches_one_by_one"
for _traced in (False, True):  # in the launches other modules share (tests.launches)
    TF_GLOO.add(__name__, f"traced={_traced}", TARGET, {"traced": _traced})
TF_GLOO3.add(__name__, "traced=False", TARGET, {"traced": False})


@pytest.mark.parametrize("np_, traced", [(2, False), (3, False), (2, True)])
def test_grouped_allreduces_keep_the_bits(np_, traced, request):
    results = {2: TF_GLOO, 3: TF_GLOO3}[np_].results(request, f"traced={traced}")
    # np 2: every kind goes grouped -- float32 sum (4), its Average with scales (2), int32
    # sum (2), max (2), float16 sum (2); np 3: the float sums run at once, one by one
    expected = [2, 2, 2, 2, 4] if np_ == 2 else [2, 2]
    assert len(results) == np_
    for res in results:
        assert res["equal"] == [True] * len(CASES)
        assert res["groups"] == expected
        assert res["held"] == 0
