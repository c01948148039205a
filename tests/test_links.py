"""Message order on each link: what NCCL (matching in posting order) can run."""

import pytest

from pipeloom.schedule import build
from pipeloom.schedule.links import out_of_order_links


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-auto"])
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (8, 16)])
def test_looped_schedules_keep_links_in_order(name, pp, m):
    assert out_of_order_links(build(name, pp, m)) == []


def test_v_schedule_link_crossing_is_named():
    (crossing,) = out_of_order_links(build("zb-v", 2, 4))
    assert (crossing.src, crossing.dst) == (0, 1)
    # rank 0 sends microbatch 2's forward before the gradient of stage 3 that rank 1 needs first
    assert (str(crossing.sent_first), str(crossing.needed_first)) == ("0F2", "3I0")


def test_runtime_refuses_crossed_links_on_an_in_order_backend():
    pytest.importorskip("torch")
    from pipeloom.errors import PipeloomError
    from pipeloom.runtime.pipeline import _check_links_for_backend

    _check_links_for_backend(build("zb-v", 2, 4), "gloo")
    _check_links_for_backend(build("1f1b", 2, 4), "nccl")
    with pytest.raises(PipeloomError, match="zb-v on nccl: rank 0 sends 0F2 to rank 1 before 3I0"):
        _check_links_for_backend(build("zb-v", 2, 4), "nccl")
