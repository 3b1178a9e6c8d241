"""Communication overlapped with compute (DESIGN.md §8): which parameters travel together, in
what order, and what that costs beside the compute. Plain data and pure functions: the planner
writes the groups and orders into the plan (`planner/intra/extract.py`), the runtime follows
them (`runtime/trainer.py`, `runtime/zero3.py`), and the simulator times them
(`sim/task_costs.py`) with `async_pass` — one definition for all three.

- **Gradient buckets** (replicated parameters, as DDP): parameters in the order their
  gradients complete in backward (the reverse of their first use in the forward), cut into
  buckets of at most ``bucket_bytes`` per (mesh axes, dtype), the first only
  ``first_bucket_bytes`` so that communication starts early. A bucket is all-reduced,
  asynchronously, once all its gradients are complete in the step's last backward and every
  bucket before it was launched; the update waits for them.
- **ZeRO-3 units** (as FSDP's per-block units): parameters in first-use order, consecutive ones
  of one block (the module path up to its first list index: ``layers.3``), one mesh axes and
  dtype form a unit, gathered by one all-gather and reduce-scattered by one. The forward
  gathers unit i + ``prefetch`` while unit i computes; the backward gathers the kept units
  again in the order it needs them (their last forward use, latest first), prefetched alike,
  and reduce-scatters each unit's gradient when it is complete, in the order they complete.
- **ZeRO-2's update gathers**: after the update, each mesh axes group's parameters (in plan
  order) by dtype, cut into buckets of at most the group's largest parameter, gathered one
  bucket at a time (`update_gather_buckets`), so the update holds one bucket beyond the
  parameters, not the group whole.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from meshplan.cost.collectives import collective_cost
from meshplan.cost.mesh import LogicalMesh
from meshplan.ir.graph import Graph
from meshplan.plan.plan import AsyncEntry, CollectiveEntry, Plan, SyncGroup

BUCKET_BYTES = 25 * 2**20        # DDP's default bucket
FIRST_BUCKET_BYTES = 2**20       # and its small first one
PREFETCH = 1                     # ZeRO-3 units gathered ahead of their use


@dataclass(frozen=True)
class ParamUse:
    """Where a parameter is used in the forward program (node indices): its first direct use
    (where ZeRO-3 gathers it, and after whose backward its gradient is complete) and its last
    use through any view (where backward first needs it)."""

    first: int
    last: int


def param_uses(graph: Graph) -> dict[str, ParamUse]:
    """Every used parameter's `ParamUse`."""
    from meshplan.planner.intra.op_costs import param_roots
    root = param_roots(graph)
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, n in enumerate(graph.nodes):
        for x in n.inputs:
            p = root.get(x)
            if p is None:
                continue
            if x == p:
                first.setdefault(p, i)
            last[p] = i
    return {p: ParamUse(first[p], last[p]) for p in first}


@dataclass(frozen=True)
class GroupParam:
    """A parameter as grouping sees it: node name, state-dict name, mesh axes, dtype, the
    bytes of its local tensor (the even split's: the same on every rank) and its uses."""

    node: str
    state: str
    axes: tuple[int, ...]
    dtype: str
    nbytes: int
    use: ParamUse


def grad_buckets(params: Sequence[GroupParam], bucket_bytes: int = BUCKET_BYTES,
                 first_bucket_bytes: int = FIRST_BUCKET_BYTES) -> tuple[SyncGroup, ...]:
    """The gradient buckets of ``params`` (module docstring), in launch order."""
    ready = sorted(params, key=lambda p: -p.use.first)
    open_: dict[tuple, list[GroupParam]] = {}
    done: list[list[GroupParam]] = []
    for p in ready:
        key = (p.axes, p.dtype)
        cap = bucket_bytes if any(key == (b[0].axes, b[0].dtype) for b in done) \
            else first_bucket_bytes
        cur = open_.setdefault(key, [])
        if cur and sum(q.nbytes for q in cur) + p.nbytes > cap:
            done.append(cur)
            cur = open_[key] = []
        cur.append(p)
    done += [b for b in open_.values() if b]
    # Launched in the order they complete: when their earliest-used parameter is.
    done.sort(key=lambda b: -min(q.use.first for q in b))
    return tuple(SyncGroup(tuple(q.node for q in b), b[0].axes, sum(q.nbytes for q in b))
                 for b in done)


def update_gather_buckets(keys: Sequence[object], nbytes: Sequence[int]) -> list[list[int]]:
    """ZeRO-2's update all-gathers of one mesh axes group (module docstring): the indices of
    its parameters (in plan order; ``keys`` their dtypes, ``nbytes`` their whole local bytes)
    per bucket, in launch order — a key's in order of first appearance, cut in order into runs
    of at most the largest parameter's bytes (a larger one alone)."""
    cap = max(nbytes, default=0)
    by_key: dict[object, list[int]] = {}
    for i, k in enumerate(keys):
        by_key.setdefault(k, []).append(i)
    out: list[list[int]] = []
    for members in by_key.values():
        run: list[int] = []
        size = 0
        for i in members:
            if run and size + nbytes[i] > cap:
                out.append(run)
                run, size = [], 0
            run.append(i)
            size += nbytes[i]
        out.append(run)
    return out


_INDEX = re.compile(r"^((?:[^.]+\.)*?\d+)(?:\.|$)")


def block_of(state: str) -> str:
    """The block a parameter belongs to: its module path up to the first list index
    (``model.layers.3.mlp.up.weight`` -> ``model.layers.3``, a Sequential's ``0.weight`` ->
    ``0``), else its own name."""
    found = _INDEX.match(state)
    return found[1] if found else state


def zero3_units(params: Sequence[GroupParam]) -> tuple[SyncGroup, ...]:
    """The ZeRO-3 units of ``params`` (module docstring), in forward order."""
    units: list[list[GroupParam]] = []
    for p in sorted(params, key=lambda q: q.use.first):
        key = (block_of(p.state), p.axes, p.dtype)
        if units and (block_of(units[-1][0].state), units[-1][0].axes,
                      units[-1][0].dtype) == key:
            units[-1].append(p)
        else:
            units.append([p])
    return tuple(SyncGroup(tuple(q.node for q in u), u[0].axes, sum(q.nbytes for q in u))
                 for u in units)


def unit_orders(units: Sequence[SyncGroup], uses: dict[str, ParamUse],
                kept: Callable[[str], bool]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the kept units in the order backward needs them again, every unit in the order its
    gradient completes)."""
    last = [max(uses[p].last for p in u.params) for u in units]
    first = [min(uses[p].first for p in u.params) for u in units]
    regather = sorted((i for i, u in enumerate(units) if any(kept(p) for p in u.params)),
                      key=lambda i: -last[i])
    scatter = sorted(range(len(units)), key=lambda i: -first[i])
    return tuple(regather), tuple(scatter)


def prefetched(order: Sequence[int], needed_at: Sequence[float], depth: int
               ) -> list[tuple[int, float]]:
    """(item, issue time) of items needed in ``order`` at the compute times ``needed_at``
    (one per item of ``order``): the runtime issues item k and the ``depth`` after it when
    item k is first needed, so item k is issued when item k - depth is needed."""
    out = []
    for k, item in enumerate(order):
        out.append((item, needed_at[max(k - depth, 0)]))
    return out


def launched(order: Sequence[int], ready_at: Sequence[float]) -> list[tuple[int, float]]:
    """(item, issue time) of items launched in ``order``, each once it is ready (``ready_at``,
    one per item of ``order``) and every earlier one was launched."""
    out, at = [], 0.0
    for item, ready in zip(order, ready_at):
        at = max(at, ready)
        out.append((item, at))
    return out


def async_pass(compute_s: float, entries: Sequence[AsyncEntry],
               cost: Callable[[AsyncEntry], float]) -> tuple[float, float]:
    """(when the pass ends, when its communication stream ends) for ``compute_s`` seconds of
    compute with ``entries`` issued on one stream beside it, in their order (the order the
    runtime issues them): an entry starts once issued and the stream is free; compute waits
    at an entry's ``wait_s`` until it is done; entries without one are waited for at the end
    of the pass, except gradient buckets ("last_backward"), waited for only by the update."""
    events = sorted(((e.issue_s, 0, k) for k, e in enumerate(entries)),
                    key=lambda x: (x[0], x[1]))
    events += [(e.wait_s, 1, k) for k, e in enumerate(entries) if e.wait_s is not None]
    events.sort(key=lambda x: (x[0], x[1], x[2]))
    delay, free, done = 0.0, 0.0, {}
    for at, what, k in events:
        if what == 0:
            free = max(free, at + delay) + cost(entries[k])
            done[k] = free
        else:
            delay = max(delay, done[k] - at)
    end = compute_s + delay
    for k, e in enumerate(entries):
        if e.wait_s is None and e.during != "last_backward":
            end = max(end, done[k])
    return end, max([end, *done.values()])


def step_passes(forward_s: float, backward_s: float, collectives: Sequence[CollectiveEntry],
                overlap: Sequence[AsyncEntry], meshes: Sequence[LogicalMesh],
                microbatches: int, replay_s: float = 0.0, update_s: float = 0.0
                ) -> tuple[float, float, float]:
    """Seconds of one micro-batch's forward and backward passes and of the update, given one
    micro-batch's compute (``forward_s``, ``backward_s``, and ``replay_s`` of its forward run
    again in backward under recomputation), the step's ``collectives`` (each
    priced on its model segment's mesh of ``meshes``) and which of them run ``overlap``-ped.

    The collectives the program issues in line (resharding, partial sums) add to their pass;
    the overlapped ones run beside it (`async_pass`). The update is what the step's last
    backward adds: its gradient buckets beyond the backward's end, plus the update's own
    collectives (ZeRO-2's gathers of the new values, Adafactor's statistics) and the
    optimizer's own pass over the parameters (``update_s``). A step of M
    micro-batches is M (forward + backward) + update, which is how the simulator's RUN and
    APPLY_GRAD tasks last (`sim/task_costs.py`)."""
    def price(kind: str, axes: tuple[int, ...], nbytes: int, segment: int = 0) -> float:
        return collective_cost(kind, meshes[segment], axes, nbytes)

    def cost(e: AsyncEntry) -> float:
        return price(e.kind, e.mesh_axes, e.bytes)

    listed = {"forward": 0.0, "backward": 0.0, "update": 0.0}
    for c in collectives:
        phase = "backward" if c.phase == "recompute" else c.phase
        listed[phase] += c.count * price(c.kind, c.mesh_axes, c.bytes, c.segment)
    during = {k: [e for e in overlap if e.during == k]
              for k in ("forward", "backward", "last_backward")}
    inline_f = listed["forward"] / microbatches - sum(map(cost, during["forward"]))
    inline_b = listed["backward"] / microbatches - sum(map(cost, during["backward"]))
    inline_u = listed["update"] - sum(map(cost, during["last_backward"]))
    compute_b = backward_s + replay_s
    fwd = async_pass(forward_s, during["forward"], cost)[0] + max(inline_f, 0.0)
    bwd_end = async_pass(compute_b, during["backward"], cost)[0]
    last_comm = async_pass(compute_b, during["backward"] + during["last_backward"], cost)[1]
    return fwd, bwd_end + max(inline_b, 0.0), last_comm - bwd_end + max(inline_u, 0.0) + update_s


def plan_units(plan: Plan, graph: Graph
               ) -> tuple[tuple[SyncGroup, ...], tuple[int, ...], tuple[int, ...]]:
    """(ZeRO-3 units, regather order, scatter order) of ``plan`` over ``graph``: the plan's
    own, or for a plan of an older meshplan (version < 3) one unit per ZeRO-3 parameter."""
    if plan.units or not any(p.update == "zero3" and p.sync_axes for p in plan.params):
        return plan.units, plan.unit_regather, plan.unit_scatter
    uses = param_uses(graph)
    params = sorted((p for p in plan.params if p.update == "zero3" and p.sync_axes
                     and p.node in uses), key=lambda p: uses[p.node].first)
    units = tuple(SyncGroup((p.node,), tuple(p.sync_axes), 0) for p in params)
    kept = {n.name: n.kept is not False for n in graph.params()}
    regather, scatter = unit_orders(units, uses, kept.__getitem__)
    return units, () if plan.recompute else regather, scatter
