"""The op-by-op memory walk (`planner/intra/liveness.py`) on a hand-checked program."""

from __future__ import annotations

import pytest

from meshplan.planner.intra.liveness import StepPeaks, Value, step_peaks

# x -> a (a temporary) -> b (kept, as a ReLU keeps its output) -> r (a view of b) -> loss,
# which also reads the parameter w (its gradient: 50 bytes).
PROGRAM = (
    Value("x", "input", (), 10.0, kept=True),
    Value("w", "param", (), 50.0, grad=True, param_grad=50.0),
    Value("a", "op", ("x",), 20.0, grad=True),
    Value("b", "op", ("a",), 30.0, kept=True, grad=True),
    Value("r", "op", ("b",), 30.0, view=True, grad=True),
    Value("loss", "op", ("r", "w"), 1.0, grad=True),
)


def test_the_walk_finds_each_passes_peak() -> None:
    # Forward: while b is made, a (20) is still live next to x and b (40 kept): 60.
    # Backward: at r, the gradients of r (30) and b (30) next to the 40 kept and w's
    # gradient made at the loss (50): 150. Accumulating into gradients already held, the
    # largest is at the loss, where w's new gradient (50) joins the 40 kept and the
    # gradients of the loss and r (31): 121.
    assert step_peaks(PROGRAM, "loss") == StepPeaks(
        kept_bytes=40.0, forward_peak=60.0, backward_peak=150.0, backward_held_peak=121.0,
        grad_bytes=50.0)


def test_an_accumulated_gradient_is_a_temporary() -> None:
    # b used twice: its gradient arrives from both users; the second is made then added.
    program = PROGRAM[:4] + (
        Value("c", "op", ("b",), 30.0, grad=True),
        Value("loss", "op", ("c", "b", "w"), 1.0, grad=True),
    )
    peaks = step_peaks(program, "loss")
    # at c: kept 40 + c's gradient 30 + b's (30) + the second of b's (30) + w's (50)
    assert peaks.backward_peak == pytest.approx(40 + 30 + 30 + 30 + 50)


def test_an_unknown_loss_is_refused() -> None:
    with pytest.raises(ValueError, match="'nope' is not among"):
        step_peaks(PROGRAM, "nope")
