"""Uneven shards are cut in whole units of the atoms every op reads a dim as (lower/grain.py),
and no member with a share is left empty (layout.split_sizes)."""

from __future__ import annotations

import torch
from torch import nn

from meshplan.capture.to_ir import capture
from meshplan.lower.grain import cut_units
from meshplan.lower.shards import cut
from meshplan.planner.intra.layout import split_sizes


class TokensThroughLinear(nn.Module):
    """(b, s, h) -> view (b*s, h) -> linear -> view back: the rows of the middle are b*s."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        return self.fc(x.reshape(b * s, h)).reshape(b, s, h)


def test_merged_rows_are_cut_in_whole_sequences() -> None:
    _, graph = capture(TokensThroughLinear(), lambda y: y.sum(), (torch.randn(8, 16, 4), None))
    units = cut_units(graph)
    merged = [n for n in graph.nodes if n.out.shape == (128, 4)]
    assert merged, [n.out.shape for n in graph.nodes]
    for n in merged:   # every (b*s, h) value: the mm's input and output alike
        assert units[(n.name, 0)] == 16, (n.name, n.op)
    # Cut 0.4/0.3/0.2/0.1, the rows stay whole sequences, as the batch itself is cut.
    weights = ((1.0,), (0.4, 0.3, 0.2, 0.1))
    rows = cut(128, (1,), weights, units[(merged[0].name, 0)])
    assert rows == tuple(16 * b for b in cut(8, (1,), weights))
    assert cut(128, (1,), weights) != rows            # cut alone, 128 rows would not be
    assert cut(128, (1,), ((1.0,), (1.0,) * 4), 16) == (32,) * 4   # even: as before


def test_no_member_with_a_share_is_left_empty() -> None:
    assert split_sizes(4, (0.4, 0.3, 0.2, 0.1)) == (1, 1, 1, 1)
    assert split_sizes(8, (0.4, 0.3, 0.2, 0.1)) == (3, 2, 2, 1)
    assert split_sizes(3, (0.4, 0.3, 0.2, 0.1)) == (1, 1, 1, 0)   # fewer rows than members
    assert split_sizes(5, (1.0, 0.0, 1.0)) == (3, 0, 2)           # no share, no row
