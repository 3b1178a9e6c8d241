"""The simulator's engine on hand-checkable pipelines: the instruction lists of each schedule
on a virtual clock, against closed forms and the schedules' own clock tables."""

from __future__ import annotations

import pytest

from meshplan.lower.instructions import Instruction, chain, mesh_programs
from meshplan.lower.schedules import make_schedule
from meshplan.sim.engine import TaskCost, simulate_programs


def _run(name: str, meshes: int, m: int, chunks: int = 1, forward: float = 1.0,
         backward: float = 2.0, transfer: float = 0.0, activation: float = 1.0):
    schedule = make_schedule(name, meshes, m, chunks)
    stages = meshes * chunks
    costs = {s: TaskCost(forward, backward, 0.0, 0.0, activation) for s in range(stages)}
    return schedule, simulate_programs(mesh_programs(schedule, chain(stages)), costs,
                                       lambda s: s % meshes, lambda *_: transfer)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [1, 2, 4])
@pytest.mark.parametrize("m", [1, 4, 8])
def test_a_step_lasts_the_fill_drain_bound(name: str, stages: int, m: int) -> None:
    """Without transfers, GPipe and 1F1B take (m + S - 1)(f + b), the fill-and-drain bound,
    and the bubble is (S - 1) / (m + S - 1) of the step."""
    _, t = _run(name, stages, m)
    assert t.step_time_s == pytest.approx((m + stages - 1) * 3.0)
    assert t.bubble_fraction() == pytest.approx((stages - 1) / (m + stages - 1))


@pytest.mark.parametrize("name,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2),
                                         ("interleaved", 4)])
@pytest.mark.parametrize("meshes,m", [(2, 4), (4, 8), (4, 16)])
def test_equal_tasks_take_the_clock_tables_length(name: str, chunks: int, meshes: int,
                                                  m: int) -> None:
    """With every task one unit long, running each mesh's list as soon as its inputs arrive
    takes exactly the schedule's clocks (the table is that timeline)."""
    schedule, t = _run(name, meshes, m, chunks, forward=1.0, backward=1.0)
    assert t.step_time_s == pytest.approx(len(schedule.clocks))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_activations_held_follow_the_schedule(name: str) -> None:
    """Peak activations per mesh: GPipe keeps every micro-batch, 1F1B at most S - i."""
    stages, m = 4, 8
    _, t = _run(name, stages, m)
    want = [m] * stages if name == "gpipe" else [stages - i for i in range(stages)]
    assert t.peak_memory() == pytest.approx(want)


def test_transfers_lie_on_the_critical_path() -> None:
    """Two stages, one micro-batch: f0, send, f1, b1, send back, b0."""
    _, t = _run("1f1b", 2, 1, transfer=0.5)
    assert t.step_time_s == pytest.approx(1 + 0.5 + 1 + 2 + 0.5 + 2)
    assert [(x.kind, x.start, x.end) for x in t.transfers] == [
        ("activation", 1.0, 1.5), ("gradient", 4.5, 5.0)]
    waits = [s for s in t.spans if s.what == "wait"]
    assert sum(s.end - s.start for s in waits) == pytest.approx(1.5 + 4.0)


def test_sends_between_two_meshes_share_one_link() -> None:
    """GPipe's forwards of stage 0 finish every 1 s while each transfer takes 2 s: they
    queue on the link, so stage 1 receives micro-batch j at 1 + 2 (j + 1)."""
    _, t = _run("gpipe", 2, 3, transfer=2.0)
    ends = [x.end for x in t.transfers if x.kind == "activation"]
    assert ends == pytest.approx([3.0, 5.0, 7.0])


def test_update_runs_after_the_last_backward() -> None:
    costs = {0: TaskCost(1.0, 2.0, 5.0, 10.0, 1.0)}
    progs = mesh_programs(make_schedule("1f1b", 1, 2, 1), {})
    t = simulate_programs(progs, costs, lambda s: 0, lambda *_: 0.0)
    assert t.step_time_s == pytest.approx(2 * 3.0 + 5.0)
    assert t.spans[-1].what == "update" and t.spans[-1].start == pytest.approx(6.0)
    assert t.peak_memory() == [11.0]


def test_lists_that_deadlock_are_refused() -> None:
    progs = [[Instruction(0, "RECV", 0, 0, "activation", 1), Instruction(0, "RUN", 0, 0,
                                                                         "forward")],
             [Instruction(0, "RECV", 1, 0, "gradient", 0)]]
    costs = {s: TaskCost(1.0, 1.0, 0.0, 0.0, 0.0) for s in (0, 1)}
    with pytest.raises(ValueError, match="deadlock"):
        simulate_programs(progs, costs, lambda s: s, lambda *_: 0.0)
    with pytest.raises(ValueError, match="no task costs for stages \\[1\\]"):
        simulate_programs(progs, {0: costs[0]}, lambda s: s, lambda *_: 0.0)


def test_passes_hold_their_temporaries_and_the_first_backward_makes_the_gradients() -> None:
    """One stage, two micro-batches (f0 b0 f1 b1): 6 of its 10 bytes of state are there
    from the start, its 4 of gradients from the first backward on, as its activations (1)
    go; each pass holds its temporaries while it runs: forward 0.5, the first backward 3
    (the gradients it makes among them), a later one 1."""
    costs = {0: TaskCost(1.0, 2.0, 0.0, 10.0, 1.0, grad_bytes=4.0, forward_extra_bytes=0.5,
                         backward_extra_bytes=3.0, backward_held_extra_bytes=1.0)}
    progs = mesh_programs(make_schedule("1f1b", 1, 2, 1), {})
    t = simulate_programs(progs, costs, lambda s: 0, lambda *_: 0.0)
    assert [b for _, b in t.memory[0]] == pytest.approx([
        6, 7, 7.5, 7,        # f0: its activations, its temporaries while it runs
        10, 7, 10,           # b0 at its peak; then its activations become the gradients
        11, 11.5, 11,        # f1
        12, 11, 10])         # b1 accumulating; its activations go
    assert t.peak_memory() == [12.0]
