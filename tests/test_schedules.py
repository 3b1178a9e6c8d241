"""Pipeline schedules and instruction lists (`lower/schedules.py`, `lower/instructions.py`):
Alpa's invariants for GPipe and 1F1B, interleaved 1F1B's smaller bubble, dependencies on the
clock, and instruction lists whose every send meets one later receive."""

from __future__ import annotations

import itertools

import pytest

from meshplan.lower.instructions import chain, format_program, mesh_programs
from meshplan.lower.schedules import make_schedule

MESHES = [2, 4, 8, 16]
MICROBATCHES = [1, 2, 4, 8, 16, 32, 64]


def _check_dependencies(sc) -> None:
    """Every task once, on its own mesh, after what it needs (at an earlier clock)."""
    when = {}
    for t, row in enumerate(sc.clocks):
        assert len(row) == sc.num_meshes
        for mesh, task in enumerate(row):
            if task is not None:
                assert sc.mesh_of(task.stage) == mesh
                key = (task.microbatch, task.stage, task.kind)
                assert key not in when
                when[key] = t
    n = sc.num_stages
    assert len(when) == 2 * n * sc.num_microbatches
    for (j, s, kind), t in when.items():
        if kind == "forward" and s > 0:
            assert when[(j, s - 1, "forward")] < t
        if kind == "backward":
            assert when[(j, s, "forward")] < t
            if s < n - 1:
                assert when[(j, s + 1, "backward")] < t


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_alpa_invariants(name: str) -> None:
    for s, m in itertools.product(MESHES, MICROBATCHES):
        sc = make_schedule(name, s, m)
        assert sc.num_clocks == (s + m - 1) * 2 + 1
        _check_dependencies(sc)
        for i in range(s):
            held = sc.max_in_flight(i)
            assert held <= (s - i if name == "1f1b" else m)
            assert held == min(s - i, m) if name == "1f1b" else held == m


@pytest.mark.parametrize("chunks", [2, 4])
def test_interleaved_shrinks_the_bubble(chunks: int) -> None:
    for s in (2, 4, 8):
        for m in (s, 2 * s, 4 * s):
            sc = make_schedule("interleaved", s, m, chunks)
            _check_dependencies(sc)
            plain = make_schedule("1f1b", s, m)
            # Clocks are 1/chunks of a stage: time in stage units drops by (S - 1)(1 - 1/v) x 2.
            assert len(sc.clocks) / chunks == pytest.approx(2 * m + 2 * (s - 1) / chunks)
            assert len(sc.clocks) / chunks < len(plain.clocks)
            assert sc.bubble_fraction() < plain.bubble_fraction()


def test_bad_schedules_are_refused() -> None:
    with pytest.raises(ValueError, match="one of"):
        make_schedule("zigzag", 2, 2)
    with pytest.raises(ValueError, match="multiple"):
        make_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="one model chunk"):
        make_schedule("1f1b", 2, 2, 2)
    with pytest.raises(ValueError, match=">= 1"):
        make_schedule("gpipe", 0, 2)


@pytest.mark.parametrize("name,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
@pytest.mark.parametrize("sends", ["chain", "skip"])
def test_every_send_meets_one_later_receive(name: str, chunks: int, sends: str) -> None:
    s, m = 4, 8
    sc = make_schedule(name, s, m, chunks)
    n = sc.num_stages
    links = chain(n) if sends == "chain" else {k: [k + 1] + ([k + 2] if k + 2 < n else [])
                                               for k in range(n - 1)}
    programs = mesh_programs(sc, links)
    sent, received = {}, {}
    for mesh, prog in enumerate(programs):
        for ins in prog:
            if ins.op == "SEND":
                key = (ins.kind, ins.microbatch, ins.stage, ins.peer)
                assert key not in sent
                sent[key] = (ins.clock, mesh)
            if ins.op == "RECV":
                key = (ins.kind, ins.microbatch, ins.peer, ins.stage)
                assert key not in received
                received[key] = (ins.clock, mesh)
    assert sent.keys() == received.keys()
    pairs = sum(len(v) for v in links.values())
    assert len(sent) == 2 * pairs * m   # activations forward, gradients back
    for key, (clock, mesh) in sent.items():
        rclock, rmesh = received[key]
        assert rclock > clock
        assert rmesh == sc.mesh_of(key[3])
    for mesh, prog in enumerate(programs):
        runs = [(i.stage, i.microbatch) for i in prog if i.op == "RUN" and i.kind == "forward"]
        frees = [(i.stage, i.microbatch) for i in prog if i.op == "FREE"]
        assert sorted(runs) == sorted(frees)
        applies = [i.stage for i in prog if i.op == "APPLY_GRAD"]
        assert applies == [k for k in range(n) if sc.mesh_of(k) == mesh]
        assert prog[-1].op == "APPLY_GRAD"
    text = format_program(programs[1])
    assert "RECV" in text and "activation mb 0 from stage 0" in text


def test_sends_must_go_forward() -> None:
    with pytest.raises(ValueError, match="later stages"):
        mesh_programs(make_schedule("1f1b", 2, 2), {1: [0]})


@pytest.mark.parametrize("s", [2, 4, 8])
@pytest.mark.parametrize("v", [1, 2, 4])
def test_the_planners_latency_is_the_clock_tables_length(s: int, v: int) -> None:
    """With equal chunks (each a forward and a backward of one clock), the step the planner
    prices (`pipeline_latency`, eq. 2 and its interleaved form) is the table's length, and a
    mesh's in-flight peak is at most the sum of its chunks' (the planner's memory bound)."""
    from meshplan.planner.inter.stage_problem import pipeline_latency
    for m in (s, 2 * s, 8 * s):
        sc = make_schedule("interleaved" if v > 1 else "1f1b", s, m, v)
        assert pipeline_latency((2.0,) * (s * v), m, v) == pytest.approx(len(sc.clocks))
        for mesh in range(s):
            chunks = range(mesh, s * v, s)
            assert sc.max_in_flight(mesh) <= sum(sc.in_flight_of(k) for k in chunks)
