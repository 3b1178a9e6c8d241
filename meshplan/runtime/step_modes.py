"""How one micro-batch's program runs: at the plan's dtype, and recomputed during backward.

Mixed precision is ``torch.autocast`` around the local program (fp32 master parameters and
gradients; matmuls at the half type). Recomputation is non-reentrant
``torch.utils.checkpoint``: only the program's inputs are kept and its forward runs again inside
backward. The replay must draw the same dropout masks (the step's generator is rewound to where
the forward started) and its collectives are recorded as phase "recompute".
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from meshplan.cost.precision import DTYPES
from meshplan.runtime.comm import Comm
from meshplan.runtime import step_casts
from meshplan.runtime.dropout import DropoutStream


def autocast_for(dtype: str, device_type: str = "cpu") -> contextlib.AbstractContextManager:
    """``torch.autocast`` on ``device_type`` at ``dtype`` ("bf16", "fp16"), or nothing for
    "fp32"."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown training dtype {dtype!r}; valid: {list(DTYPES)}")
    if dtype == "fp32" or device_type == "meta":   # meta: shapes only, no autocast there
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=getattr(torch, DTYPES[dtype]))


def recomputed(program: Callable[..., torch.Tensor], args: Sequence[torch.Tensor],
               rng: torch.Generator, comm: Comm) -> torch.Tensor:
    """``program(*args)`` keeping only ``args`` for backward, which reruns the forward (with
    the step's parameter casts, which the backward runs outside of)."""
    casts = step_casts.active()

    @contextlib.contextmanager
    def again(start: torch.Tensor) -> Iterator[None]:
        with _replay(rng, start, comm), \
                casts.active() if casts is not None else contextlib.nullcontext():
            yield

    def contexts() -> tuple[contextlib.AbstractContextManager, ...]:
        # Entered when the replay runs, not now: the forward runs as the forward (its
        # collectives recorded as such, its batch norms updating their statistics once).
        return contextlib.nullcontext(), again(rng.get_state())

    # The whole forward reruns, as the plan counts it: torch's early stop would end the replay
    # once the last saved tensor is back, skipping trailing collectives (a pipeline stage's
    # reduction of what it sends) that the plan lists under "recompute".
    with set_checkpoint_early_stop(False):
        return checkpoint(program, *args, use_reentrant=False, context_fn=contexts)


@contextlib.contextmanager
def _replay(rng: torch.Generator | None, start: torch.Tensor | None, comm: Comm | None
            ) -> Iterator[None]:
    now = rng.get_state() if rng is not None else None
    if rng is not None:
        rng.set_state(start)
    if comm is not None:
        comm.recomputing = True
    try:
        yield
    finally:
        if comm is not None:
            comm.recomputing = False
        if rng is not None:
            rng.set_state(now)


def segmented(gm: torch.fx.GraphModule, segment_of: Callable[[str], int | None],
              owned: Callable[[str], bool],
              around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
              ) -> torch.fx.GraphModule:
    """``gm`` cut into pieces, each segment (``segment_of``: a node's replayed segment, None
    where it runs plainly; node names of ``gm``) recomputed on its own in backward: a
    micro-batch keeps what a segment reads and passes out, and the backward holds one segment's
    activations at a time, each replay drawing its own dropout masks again and recording its
    collectives as "recompute" (`planner/recompute.py`: every clustered layer a segment is
    Megatron-LM's full recomputation; its attention cores, its selective one). A node no IR
    node owns (``owned`` false: a constant) goes with its first user. ``around()`` is entered
    around each segment's run and replay (what the program needs of its trainer, e.g.
    ZeRO-3's units)."""
    from torch.fx.passes.split_module import split_module
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    order = {n.name: i for i, n in enumerate(nodes)}
    seg = {n.name: segment_of(n.name) for n in nodes}
    for n in reversed(nodes):   # users first: a constant's first user is already placed
        if not owned(n.name):
            users = sorted((u.name for u in n.users if u.name in seg), key=order.__getitem__)
            seg[n.name] = seg[users[0]] if users else None
    # A segment is one piece even where plain nodes run between its nodes: one that does not
    # depend on the segment (a mask sliced between the scores and the softmax) moves before
    # the segment; one that does stays after it, and the segment must not read it.
    span: dict[int, tuple[int, int]] = {}
    for n in nodes:
        if seg[n.name] is not None:
            first, _ = span.get(seg[n.name], (order[n.name], 0))
            span[seg[n.name]] = (first, order[n.name])
    inside, tainted, after = None, set(), set()
    for n in nodes:
        s_n, i = seg[n.name], order[n.name]
        if s_n is not None and span[s_n][0] == i:
            inside, tainted, after = s_n, set(), set()
        if inside is None or i > span[inside][1]:
            inside = None
            continue
        reads = {a.name for a in n.all_input_nodes}
        if s_n is None and not reads & tainted:
            nodes[span[inside][0]].prepend(n)   # hoisted, in order, before the segment
            continue
        if s_n is not None and reads & after:
            raise ValueError(f"meshplan internal error: {n.name} of recomputed segment {s_n} "
                             f"reads {sorted(reads & after)}, made from the segment outside "
                             "it: the segment cannot be replayed as one piece")
        tainted.add(n.name)
        if s_n is None:
            after.add(n.name)
    # Pieces: each segment, and each run of plain nodes between them, numbered in order.
    piece: dict[str, int] = {}
    ids: dict[tuple, int] = {}
    runs, last = 0, None
    for n in (n for n in gm.graph.nodes if n.name in seg):
        if seg[n.name] is None:
            runs += last is not None and last[0] == "segment"
            key: tuple = ("plain", runs)
        else:
            key = ("segment", seg[n.name])
        last = key
        piece[n.name] = ids.setdefault(key, len(ids))
    replayed = {i for k, i in ids.items() if k[0] == "segment"}
    split = split_module(gm, None, lambda n: piece[n.name], keep_original_order=True)
    for name, sub in list(split.named_children()):
        if name.startswith("submod_") and int(name.removeprefix("submod_")) in replayed:
            setattr(split, name, _Recomputed(sub, around))
    return split


class _Recomputed(torch.nn.Module):
    """One layer of a local program, checkpointed (`layered`)."""

    def __init__(self, layer: torch.nn.Module,
                 around: Callable[[], contextlib.AbstractContextManager]) -> None:
        super().__init__()
        self.layer, self.around = layer, around

    def _run(self, *args: Any) -> Any:
        with self.around():
            return self.layer(*args)

    def forward(self, *args: Any) -> Any:
        rng = next((a for a in args if isinstance(a, (torch.Generator, DropoutStream))), None)
        comm = next((a for a in args if isinstance(a, Comm)), None)

        def contexts() -> tuple[contextlib.AbstractContextManager, ...]:
            return contextlib.nullcontext(), _replay(rng, rng.get_state() if rng else None,
                                                     comm)

        with set_checkpoint_early_stop(False):
            return checkpoint(self._run, *args, use_reentrant=False, context_fn=contexts)
