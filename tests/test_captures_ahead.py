"""Programs traced ahead in a forked process (`capture/ahead.py`): the walk over micro-batch
counts has the next count traced while it prices the current one. A trace made ahead must be
the trace made in place, a failure must surface as the in-place trace's, and a trace no longer
wanted must not outlive the search."""

from __future__ import annotations

import os

import pytest

import meshplan.api as api
import meshplan.planner.inter.search as search
from meshplan import forked
from meshplan.capture import memo
from meshplan.capture.ahead import CapturesAhead
from meshplan.errors import MicrobatchError
from meshplan.zoo.spec import build_workload

SPEC = "gpt:hidden=64,layers=4,heads=4,seq=16,vocab=128,batch=8"


def _traces(spec: str = SPEC):
    w = build_workload(spec, device="meta")
    return lambda num: api._count_graph(w.model, w.loss_fn, w.example_batch, num)


def test_a_trace_made_ahead_is_the_trace_made_in_place() -> None:
    ahead, here = CapturesAhead(_traces()), CapturesAhead(_traces())
    ahead.ahead(4)
    assert 4 in ahead._pending
    graph, fingerprint = ahead(4)
    assert not ahead._pending
    same, same_fingerprint = here(4)
    assert fingerprint == same_fingerprint
    assert [(n.name, n.op, n.inputs, n.out) for n in graph.nodes] == \
        [(n.name, n.op, n.inputs, n.out) for n in same.nodes]
    assert ahead(4)[0] is graph   # asked again: the same program


def test_a_failed_trace_ahead_fails_in_place_as_it_would() -> None:
    # Batch norm on one sample a channel: the model cannot run on one sample a micro-batch.
    traces = _traces("wresnet:layers=26,width=2,batch=8")
    graphs = CapturesAhead(traces)
    graphs.ahead(8)
    with pytest.raises(MicrobatchError):
        graphs(8)
    assert not graphs._pending


def test_traces_no_longer_wanted_are_stopped() -> None:
    graphs = CapturesAhead(_traces())
    graphs.ahead(2)
    child = graphs._pending[2].process
    graphs.close()
    assert not graphs._pending and not child.is_alive()
    graphs(2)   # still traced in place when asked after all


def test_the_walk_has_the_next_count_traced_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    w = build_workload(SPEC, device="meta")
    asked: list[int] = []
    priorities: dict[int, str] = {}
    ahead = CapturesAhead.ahead

    def spy(self, count, priority="nice"):   # noqa: ANN001 - the method's own signature
        asked.append(count)
        priorities.setdefault(count, priority)
        ahead(self, count, priority)

    monkeypatch.setattr(CapturesAhead, "ahead", spy)
    searched: list[int] = []
    one = search._search_one

    def spy_search(graph_for, b, req, *rest):   # noqa: ANN001, ANN002
        searched.append(b)
        return one(graph_for, b, req, *rest)

    monkeypatch.setattr(search, "_search_one", spy_search)

    def plan(workers: str) -> None:
        monkeypatch.setenv("MESHPLAN_WORKERS", workers)
        asked.clear()
        searched.clear()
        api.plan(w.model, w.loss_fn, "sgd", w.example_batch, "p3.16xlarge:1x4",
                 method="inter-only")

    plan(str(search.AHEAD_ABOVE_CORES + 1))
    assert len(searched) > 1
    # Every count searched after the first was asked for ahead, before its search.
    assert set(searched[1:]) <= set(asked)
    assert all(priorities[c] == "nice" for c in asked)
    plan(str(search.AHEAD_ABOVE_CORES))   # one core: no idle cycles for a trace beside
    assert len(searched) > 1 and not asked


def test_the_probe_is_traced_beside_the_walk_below_its_next_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe (the most micro-batches that give every device a sample: 8 of 64 on 8
    devices), which the walk down from 64 seldom reaches, is traced ahead at the idle
    priority once two counts are traced (its floor can then be extrapolated)."""
    w = build_workload(SPEC.replace("batch=8", "batch=64"), device="meta")
    asked: list[tuple[int, str]] = []
    ahead = CapturesAhead.ahead

    def spy(self, count, priority="nice"):   # noqa: ANN001 - the method's own signature
        asked.append((count, priority))
        ahead(self, count, priority)

    monkeypatch.setattr(CapturesAhead, "ahead", spy)
    monkeypatch.setenv("MESHPLAN_WORKERS", str(search.AHEAD_ABOVE_CORES + 1))
    api.plan(w.model, w.loss_fn, "sgd", w.example_batch, "p3.16xlarge:1x8",
             method="inter-only")
    assert asked[:3] == [(32, "nice"), (16, "nice"), (8, "idle")]


def test_a_stuck_trace_ahead_is_traced_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """A child that neither runs nor delivers (forked while a thread held a lock the trace
    needs) is stopped, and the count traced here: the search must not hang on it."""
    import os
    import threading

    monkeypatch.setattr(forked, "STUCK_AFTER_S", 0.5)
    parent, trace = os.getpid(), _traces()
    held = threading.Lock()
    held.acquire()   # as a thread of the parent held it when the process forked

    def blocking(num: int):
        if os.getpid() != parent:
            held.acquire()   # never released in the child
        return trace(num)

    graphs = CapturesAhead(blocking)
    graphs.ahead(2)
    child = graphs._pending[2].process
    graph, fingerprint = graphs(2)
    held.release()
    assert not child.is_alive() and fingerprint == CapturesAhead(trace)(2)[1]


class _Niceness:
    """What a child's "trace" returns here: the niceness it ran at."""

    def __init__(self) -> None:
        self.value = os.nice(0)

    def fingerprint(self) -> str:
        return str(self.value)


def test_a_trace_ahead_takes_only_the_cycles_the_search_leaves_idle() -> None:
    graphs = CapturesAhead(lambda num: _Niceness())
    graphs.ahead(2)
    assert graphs(2)[0].value == min(os.nice(0) + forked.NICENESS, 19)
    assert graphs(3)[0].value == os.nice(0)   # traced in place: the search's own priority


def test_a_program_made_ahead_is_the_one_later_searches_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A count traced in a child is the program every later search of the request reads (the
    typed-stage search reads the uniform search's stage prices by the program's signatures,
    which a second trace would name anew), and the program of a few samples a plan's loss
    scaling looks for (`api._few_samples_program`)."""
    w = build_workload(SPEC, device="meta")
    made: dict[int, object] = {}
    collect = CapturesAhead._collect

    def spy(self, count):   # noqa: ANN001 - the method's own signature
        graph = collect(self, count)
        if graph is not None:
            made[count] = graph
        return graph

    monkeypatch.setattr(CapturesAhead, "_collect", spy)
    monkeypatch.setenv("MESHPLAN_WORKERS", str(search.AHEAD_ABOVE_CORES + 1))
    api.plan(w.model, w.loss_fn, "sgd", w.example_batch, "p3.16xlarge:1x4",
             method="inter-only")
    assert made
    for count, graph in made.items():
        micro = api.split_microbatches(w.example_batch, count)[0]
        assert memo.program_made_already(w.model, w.loss_fn, micro) is graph
        assert api._count_graph(w.model, w.loss_fn, w.example_batch, count) is graph


def test_a_starved_trace_ahead_is_traced_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """A child that gets a small share of a core (niced, on a machine other work keeps busy)
    is not waited for: the count is traced here, in about the time a trace takes."""
    import time

    monkeypatch.setattr(forked, "STUCK_AFTER_S", 0.5)
    parent, trace = os.getpid(), _traces()

    def starved(num: int):
        if os.getpid() != parent:   # a tenth of a core, for far longer than a trace takes
            end = time.monotonic() + 60
            while time.monotonic() < end:
                busy = time.monotonic() + 0.005
                while time.monotonic() < busy:
                    pass
                time.sleep(0.045)
        return trace(num)

    graphs = CapturesAhead(starved)
    graphs.ahead(2)
    child = graphs._pending[2].process
    began = time.monotonic()
    graph, fingerprint = graphs(2)
    assert time.monotonic() - began < 20
    assert not child.is_alive() and fingerprint == CapturesAhead(trace)(2)[1]
