"""One rank program exercising both uneven-collective impls (padded, broadcast), forward and
backward, plus its single-process oracle; run by the emulated and the gloo tests alike.

Values span six orders of magnitude so that a float32 sum taken in another order differs in
its last bits: a test that demands bitwise equality of sums can tell summation orders apart.
"""

from __future__ import annotations

from typing import Any

import torch

from meshplan.runtime import collectives as C
from meshplan.runtime.comm import Comm, ProcessGroupComm

AXES = (0, 1)  # every rank of a 4-rank mesh, so both (1, 4) and (2, 2) give one 4-member group
SIZES = {"desc": [4, 3, 2, 1], "zero": [2, 0, 3, 1]}  # HAP-like shares; "zero": an idle member
WIDTH = 5


def values(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random float32 values of mixed magnitude (1e-3 .. 1e3)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen) * 10.0 ** torch.randint(-3, 4, shape, generator=gen)


def shard(rank: int, size: int, case: str) -> torch.Tensor:
    """Rank's all-gather input: ``size`` columns of a ``(WIDTH, ·)`` tensor (gathered on dim 1)."""
    return values((WIDTH, size), 10 * rank + len(case))


def full(rank: int, total: int, case: str) -> torch.Tensor:
    """Rank's reduce-scatter input: ``(total, WIDTH)``, scattered along dim 0."""
    return values((total, WIDTH), 1000 + 10 * rank + len(case))


def weight(rank: int, shape: torch.Size, case: str) -> torch.Tensor:
    """The loss weight on rank's output (loss = sum(out * weight)), so d loss / d out = weight."""
    return values(tuple(shape), 5000 + 10 * rank + len(case))


def impl_program(comm: Comm, impl: str) -> dict[str, Any]:
    """Per case: an all-gather with reduce-scatter backward and a reduce-scatter (all-gather
    backward), both by ``impl``; returns outputs, input gradients and the records."""
    out: dict[str, Any] = {}
    me = comm.group_index(AXES)
    for case, sizes in SIZES.items():
        x = shard(comm.rank, sizes[me], case).requires_grad_()
        y = C.all_gather(comm, x, AXES, 1, sizes, backward="reduce_scatter", impl=impl)
        (y * weight(comm.rank, y.shape, "ag" + case)).sum().backward()
        out["ag_" + case], out["ag_grad_" + case] = y.detach(), x.grad
        z = full(comm.rank, sum(sizes), case).requires_grad_()
        w = C.reduce_scatter(comm, z, AXES, 0, sizes, impl=impl)
        (w * weight(comm.rank, w.shape, "rs" + case)).sum().backward()
        out["rs_" + case], out["rs_grad_" + case] = w.detach(), z.grad
    out["records"] = list(comm.records)
    return out


def gloo_impl_program(rank: int, nprocs: int, mesh: tuple[int, int], impl: str
                      ) -> dict[str, Any]:
    """:func:`impl_program` on a gloo worker of a WorkerPool."""
    return impl_program(ProcessGroupComm(mesh), impl)


def member_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Left-to-right sum in member order (the emulation's order)."""
    total = tensors[0].clone()
    for t in tensors[1:]:
        total += t
    return total


def oracle(num_ranks: int) -> list[dict[str, torch.Tensor]]:
    """What each rank of :func:`impl_program` should get, by plain torch on every rank's data."""
    want: list[dict[str, torch.Tensor]] = [{} for _ in range(num_ranks)]
    ranks = range(num_ranks)
    for case, sizes in SIZES.items():
        gathered = torch.cat([shard(r, sizes[r], case) for r in ranks], dim=1)
        ag_grad = member_sum([weight(r, gathered.shape, "ag" + case) for r in ranks])
        summed = member_sum([full(r, sum(sizes), case) for r in ranks])
        pieces = torch.split(summed, sizes, dim=0)
        rs_grad = torch.cat([weight(r, pieces[r].shape, "rs" + case) for r in ranks], dim=0)
        for r in ranks:
            want[r]["ag_" + case] = gathered
            want[r]["ag_grad_" + case] = torch.split(ag_grad, sizes, dim=1)[r]
            want[r]["rs_" + case] = pieces[r]
            want[r]["rs_grad_" + case] = rs_grad
    return want


SUM_KEYS = tuple(k + c for c in SIZES for k in ("ag_grad_", "rs_"))  # reduced: order matters
COPY_KEYS = tuple(k + c for c in SIZES for k in ("ag_", "rs_grad_"))  # gathered: exact copies
