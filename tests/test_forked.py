"""Work done in a forked child at a low priority (`meshplan/forked.py`): its answer is the one
made in place, what it raises is raised here, what cannot come back is made here, and its
warnings are issued here as the call in place would issue them."""

from __future__ import annotations

import os
import threading
import warnings

import pytest

from meshplan import forked
from meshplan.errors import InfeasiblePlanError
from meshplan.forked import Forked, value_or_in_place

pytestmark = pytest.mark.skipif(not forked.forks(), reason="processes do not fork here")


def _in_child(parent: int, fn):   # noqa: ANN001, ANN202 - any callable
    """``fn`` that fails the test's expectations if it runs in the parent."""
    def run():   # noqa: ANN202
        assert os.getpid() != parent
        return fn()
    return run


def test_a_value_made_in_a_child_is_the_value_made_in_place() -> None:
    got = value_or_in_place(Forked(_in_child(os.getpid(), lambda: {"a": [1.5, (2, "x")]})),
                            lambda: pytest.fail("made in place"))
    assert got == {"a": [1.5, (2, "x")]}


def test_what_a_child_raises_is_raised_here() -> None:
    def infeasible():   # noqa: ANN202
        raise InfeasiblePlanError(16e9, 17e9, "use more devices")

    child = Forked(_in_child(os.getpid(), infeasible))
    with pytest.raises(InfeasiblePlanError, match="use more devices") as e:
        value_or_in_place(child, lambda: pytest.fail("made in place"))
    assert (e.value.budget_bytes, e.value.min_memory_bytes) == (16e9, 17e9)


def test_what_cannot_come_back_is_made_here() -> None:
    made_here = []

    def unpicklable():   # noqa: ANN202
        made_here.append(os.getpid())
        return threading.Lock()   # a lock does not pickle

    got = value_or_in_place(Forked(unpicklable), unpicklable)
    assert made_here == [os.getpid()] and isinstance(got, type(threading.Lock()))


@pytest.mark.parametrize("priority", forked.PRIORITIES)
def test_a_child_runs_below_the_search(priority: str) -> None:
    def seen():   # noqa: ANN202
        return os.nice(0), os.sched_getscheduler(0)

    niceness, policy = Forked(seen, priority).outcome()[1]
    assert niceness == min(os.nice(0) + forked.NICENESS, 19)
    assert (policy == os.SCHED_IDLE) == (priority == "idle")


def _warns(message: str) -> None:
    warnings.warn(message, UserWarning, stacklevel=1)


def test_a_childs_warnings_are_issued_here_once() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        _warns("meshplan: shown here first")
        value_or_in_place(Forked(lambda: (_warns("meshplan: shown here first"),
                                          _warns("meshplan: only in the child"))),
                          lambda: pytest.fail("made in place"))
    assert [str(w.message) for w in caught] == ["meshplan: shown here first",
                                                "meshplan: only in the child"]
    assert all(w.filename == __file__ for w in caught)
