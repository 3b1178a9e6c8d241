"""Read an ILP solution back into plan decisions: per-op strategies, parameters, collectives.

The collective list is derived from the same resharding recipes the ILP priced and lowering
emits, plus the parameters' synchronization as the runtime groups it (`lower/overlap.py`):
replicated gradients all-reduced in buckets, overlapped with the last backward; ZeRO-2
gradients reduce-scattered one by one in every backward, the new values all-gathered in one
bucket per mesh axes after the update; ZeRO-3 parameters gathered and their gradients
reduce-scattered per unit, prefetched. Where each overlapped collective falls on its pass's
compute (`AsyncEntry`) is worked out here, from each op's own times, and priced by
`lower/overlap.step_passes` — the simulator's own function.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from meshplan.cost.collectives import collective_cost
from meshplan.ir.graph import Node
from meshplan.lower import overlap as ov
from meshplan.lower.factored_stats import factored_buckets, update_dims
from meshplan.planner.intra.choices import Choice, NodeChoices
from meshplan.planner.intra.fanout import param_sync, use_charges
from meshplan.planner.intra.formulate import Formulation
from meshplan.planner.intra.op_costs import (CostContext, OpCosts, is_kept, local_bytes,
                                             step_cost, zero_counts)
from meshplan.planner.intra.ilp_problem import working_peak
from meshplan.planner.intra.liveness import StepPeaks, Value, segmented_peaks, step_peaks
from meshplan.planner.intra.reshard import Recipe
from meshplan.planner.intra.layout import Layout
from meshplan.plan.plan import (AsyncEntry, CollectiveEntry, OpDecision, ParamDecision,
                                SourceDecision, SyncGroup)


@dataclass(frozen=True)
class IntraResult:
    ops: tuple[OpDecision, ...]
    params: tuple[ParamDecision, ...]
    sources: tuple[SourceDecision, ...]
    collectives: tuple[CollectiveEntry, ...]
    loss_partial_axes: tuple[int, ...]
    peak_memory_bytes: float
    step_time_s: float
    # What the simulator runs on (`sim/task_costs.py`), per device and micro-batch unless
    # said: seconds of compute of one forward and one backward (no recomputation), bytes of
    # parameter/gradient/optimizer state and of kept activations, the program's forward FLOPs
    # (all devices together), the samples of one step and the seconds of the optimizer's
    # pass over the device's parameters once per step ("update_s").
    figures: dict[str, float]
    # Every collective with the node that owns it (the op whose partial sums it reduces or
    # whose operand it moves, the parameter it synchronizes; "" for the update's buckets).
    owned: tuple[tuple[str, CollectiveEntry], ...] = ()
    sync: "Sync | None" = None


@dataclass(frozen=True)
class Sync:
    """The parameters' grouping and overlap, as the `Plan` fields of those names."""

    buckets: tuple[SyncGroup, ...] = ()
    units: tuple[SyncGroup, ...] = ()
    unit_regather: tuple[int, ...] = ()
    unit_scatter: tuple[int, ...] = ()
    prefetch: int = ov.PREFETCH
    overlap: tuple[AsyncEntry, ...] = ()

    def fields(self) -> dict:
        return {"buckets": self.buckets, "units": self.units,
                "unit_regather": self.unit_regather, "unit_scatter": self.unit_scatter,
                "prefetch": self.prefetch, "overlap": self.overlap}


def node_indices(form: Formulation, choices: tuple[int, ...]) -> dict[str, int]:
    """Each node's index into its own choice list (a follower shares its root's index)."""
    by_root = dict(zip(form.roots, choices))
    return {n.name: by_root[form.choices.root_of[n.name]] for n in form.choices.graph.nodes}


def storage_layout(spec: Layout, mode: str, sync_axes: tuple[int, ...]) -> Layout:
    """ZeRO-3 keeps dim 0 of the local tensor further split over the data-parallel axes."""
    if mode != "zero3" or not spec.dims:
        return spec
    return Layout(((*spec.dims[0], *sync_axes), *spec.dims[1:]))


def extract(form: Formulation, choices: tuple[int, ...], real: CostContext,
            layers: Mapping[str, int] | None = None) -> IntraResult:
    """Decisions, collectives and predictions of the assignment ``choices``; ``layers``: under
    recomputation each replayed node's segment (`planner/recompute.py`).

    ``real`` prices the prediction on the cluster's own bandwidths with the compute roofline,
    whatever units the ILP used. Each fan-out key (`fanout.py`) is counted once, at its first use.
    """
    nc, g = form.choices, form.choices.graph
    idx = node_indices(form, choices)
    costs, real_costs = OpCosts(nc, form.ctx), OpCosts(nc, real)
    counts: Counter[tuple[str, int, tuple[int, ...], str, str]] = Counter()
    sync: dict[str, list[tuple[int, ...]]] = {}
    sfb: dict[str, tuple[int, ...]] = {}    # SFB weights and the axes their factors gather
    seen: set[tuple] = set()
    memory, state, forward, backward, update = 0.0, 0.0, 0.0, 0.0, 0.0
    comm: Counter[str] = Counter()      # reducing the op's own partial sums; parameter sync
    reshard: Counter[str] = Counter()   # bringing operands into the layouts the op needs
    times: list[tuple[float, float]] = []   # each node's forward and backward seconds
    tally = _Tally(counts, comm, reshard, sync, sfb, seen)
    for node in g.nodes:
        choice = nc.choices[node.name][idx[node.name]]
        held = costs.memory(node, choice)
        memory += held
        state += held if node.role in ("param", "buffer") else 0.0
        f, b = real_costs.pass_times(node, choice)
        times.append((f, b))
        forward, backward = forward + f, backward + b
        update += real_costs.update_cost(node, choice)
        _count_syncs(form, costs, node, choice, counts)
        comm[node.name] += costs.stat_sync_cost(node, choice)
        for axes in _count_moves(form, costs, node, choice, idx, tally):
            backward += real_costs.sfb_extra_s(node, axes) / real.microbatches
    ops = []
    for node in g.nodes:
        if node.is_source:
            continue
        choice = nc.choices[node.name][idx[node.name]]
        s = choice.strategy
        ops.append(OpDecision(node.name, node.op, s.describe(node.sig),
                              tuple(lay.spec() for lay in s.inputs), s.output.spec(),
                              s.grad_partial, costs.compute_cost(node, choice), comm[node.name],
                              reshard[node.name], costs.memory(node, choice), s.sync_axes))
    params, grouped = _params(form, idx, sync, sfb, counts)
    groups = _sync(form, grouped, times, *_sync_counts(form, grouped, counts))
    working = working_peak(form.problem, choices)
    sources = tuple(SourceDecision(n.name, n.role,
                                   nc.choices[n.name][idx[n.name]].strategy.output.spec(),
                                   n.state_name or "")
                    for n in g.nodes if n.role in ("input", "target"))
    owned = tuple((o, CollectiveEntry(k, b, a, p, c))
                  for (k, b, a, p, o), c in sorted(counts.items()))
    colls = _merged(entry for _, entry in owned)
    m = real.microbatches
    replay = sum(t[0] for n, t in zip(g.nodes, times) if real.replays(n.name)) \
        if real.recompute else 0.0
    f_s, b_s, u_s = ov.step_passes(forward, backward, colls, groups.overlap, [real.mesh], m,
                                   replay, update)
    loss = nc.choices[g.loss][idx[g.loss]].strategy.output
    batch = next((n.out.shape[0] for n in g.nodes if n.role == "input" and n.out.shape), 0)
    # Recomputed segment by segment (`liveness.segmented_peaks`) where they are known.
    peaks = step_peaks_of(costs, nc, idx, layers if real.recompute else None)
    figures = {"forward_s": forward, "backward_s": backward, "update_s": update,
               "state_bytes": state,
               "activation_bytes": memory - state, "working_bytes": working,
               "grad_bytes": peaks.grad_bytes, "forward_peak_bytes": peaks.forward_peak,
               "backward_peak_bytes": peaks.backward_peak,
               "backward_held_peak_bytes": peaks.backward_held_peak,
               "forward_flops": float(sum(n.flops for n in g.nodes if not n.is_source)),
               "batch_size": batch * form.ctx.microbatches}
    peak = memory + working
    if real.recompute:   # the forward's replay: its seconds and FLOPs per micro-batch
        replayed = [(n, t[0]) for n, t in zip(g.nodes, times) if real.replays(n.name)]
        figures["replay_s"] = sum(t for _, t in replayed)
        figures["replay_flops"] = float(sum(n.flops for n, _ in replayed if not n.is_source))
    if layers is not None and real.recompute:   # what a micro-batch keeps: its layers' inputs
        figures["layered_kept_bytes"] = peaks.kept_bytes
        # The step's peak by the op-by-op walk, as the simulator follows it (one stage): the
        # state without gradients, then the first backward's peak, or once the gradients
        # exist they and the larger of a forward's and a later backward's.
        grads = peaks.grad_bytes
        later = max(peaks.forward_peak, peaks.backward_held_peak) if m > 1 else \
            peaks.forward_peak - grads
        peak = state - grads + working + max(peaks.forward_peak, peaks.backward_peak,
                                             grads + later)
    return IntraResult(tuple(ops), params, sources, colls, loss.partial, peak,
                       m * (f_s + b_s) + u_s, figures, owned, groups)


@dataclass
class _Tally:
    """What `extract` counts while it walks the plan's moves (`_count_moves`)."""

    counts: Counter
    comm: Counter
    reshard: Counter
    sync: dict
    sfb: dict
    seen: set


def _count_syncs(form: Formulation, costs: OpCosts, node: Node, choice: Choice,
                 counts: Counter) -> None:
    """The collectives ``node``'s own partial sums and parameter sync issue, per phase."""
    for kind, nbytes, axes, phase in costs.stat_sync(node, choice):
        for label, n in form.ctx.phase_counts(phase, node.name):
            counts[(kind, nbytes, axes, label, node.name)] += n


def _count_moves(form: Formulation, costs: OpCosts, node: Node, choice: Choice,
                 idx: dict[str, int], tally: _Tally) -> list[tuple[int, ...]]:
    """Count the moves that bring ``node``'s operands into its layouts (each fan-out key once,
    at its first use) into ``tally``; returns the work axes of each SFB weight gradient, whose
    factors' product the backward computes (its seconds are the caller's to add, in order)."""
    sfb_axes = []
    for j, name in enumerate(node.inputs):
        charges = use_charges(costs, node, j, idx[name], idx[node.name])
        assert charges is not None, f"forbidden operand layout chosen for {node.name}"
        for _, key, cost in charges:
            if key[0] == "sync":
                tally.sync.setdefault(key[1], []).append(key[4])
                if key not in tally.seen:
                    tally.comm[node.name] += cost
            elif key[0] == "sfb":
                tally.sfb[key[1]] = key[2]
                axes = choice.strategy.work_axes   # its whole-batch product is compute
                tally.comm[node.name] += cost - costs.sfb_extra_s(node, axes)
                sfb_axes.append(axes)
                for step in key[3]:   # the factors' all-gathers, every backward
                    for label, n in form.ctx.phase_counts("backward"):
                        tally.counts[("all_gather", step.nbytes, step.axes, label,
                                      node.name)] += n
            elif key not in tally.seen:
                _count_recipe(key[2], form.choices.graph.by_name[name].requires_grad, form.ctx,
                              tally.counts, tally.comm, tally.reshard, name, node.name)
            tally.seen.add(key)
    return sfb_axes


def plan_collectives(form: Formulation, choices: tuple[int, ...]
                     ) -> tuple[CollectiveEntry, ...]:
    """The collectives of the assignment ``choices`` as `extract` lists them
    (``IntraResult.collectives``), without the times, memory and decisions that make most of
    its work (`recompute_extra_s` asks a plan's forward collectives of every replay priced)."""
    nc = form.choices
    idx = node_indices(form, choices)
    costs = OpCosts(nc, form.ctx)
    tally = _Tally(Counter(), Counter(), Counter(), {}, {}, set())
    for node in nc.graph.nodes:
        choice = nc.choices[node.name][idx[node.name]]
        _count_syncs(form, costs, node, choice, tally.counts)
        _count_moves(form, costs, node, choice, idx, tally)
    _, grouped = _params(form, idx, tally.sync, tally.sfb, tally.counts)
    _sync_counts(form, grouped, tally.counts)
    return _merged(CollectiveEntry(k, b, a, p, c)
                   for (k, b, a, p, _), c in sorted(tally.counts.items()))


def _merged(entries: Iterable[CollectiveEntry]) -> tuple[CollectiveEntry, ...]:
    """Entries of the same kind, size, axes and phase as one, sorted."""
    total: Counter[tuple[str, int, tuple[int, ...], str]] = Counter()
    for c in entries:
        total[(c.kind, c.bytes, c.mesh_axes, c.phase)] += c.count
    return tuple(CollectiveEntry(k, b, a, p, c) for (k, b, a, p), c in sorted(total.items()))


def step_peaks_of(costs: OpCosts, nc: NodeChoices, idx: dict[str, int],
                  layers: Mapping[str, int] | None = None) -> StepPeaks:
    """The op-by-op memory walk (`liveness`) on the chosen layouts; ``layers``: recomputed
    segment by segment (each replayed node's segment)."""
    values = []
    for node in nc.graph.nodes:
        choice = nc.choices[node.name][idx[node.name]]
        lay = choice.strategy.output
        values.append(Value(
            node.name, node.role, node.inputs, float(local_bytes(node, lay, costs.shape)),
            kept=is_kept(node), view=node.sig is not None and node.sig.kind == "view",
            grad=node.requires_grad,
            param_grad=costs.param_memory(node, choice).grad_bytes if node.role == "param"
            else 0.0))
    if layers is not None:
        return segmented_peaks(values, nc.graph.loss, layers)
    return step_peaks(values, nc.graph.loss)


def recompute_extra_s(form: Formulation, choices: tuple[int, ...], real: CostContext,
                      recomputed: frozenset[str] | None = None) -> float:
    """Seconds recomputation adds to the step of the plan ``choices``: the forward of every op
    (of ``recomputed`` when given) and the forward-phase collectives issued running them once
    more per micro-batch (as `extract` prices the plan under ``replace(real, recompute=True,
    recomputed=recomputed)``, at the cost of one `extract` without it for the whole
    program's)."""
    assert not real.recompute, "the extra of recomputation is priced from the plain step"
    again = replace(real, recompute=True, recomputed=recomputed)
    if recomputed is None:
        comm = sum(c.count * collective_cost(c.kind, real.mesh, c.mesh_axes, c.bytes)
                   for c in plan_collectives(form, choices) if c.phase == "forward")
    else:   # which collectives replay depends on who issues them: count them replayed
        replayed = extract(replace(form, ctx=replace(form.ctx, recompute=True,
                                                     recomputed=recomputed)), choices, again)
        comm = sum(c.count * collective_cost(c.kind, real.mesh, c.mesh_axes, c.bytes)
                   for c in replayed.collectives if c.phase == "recompute")
    nc, idx = form.choices, node_indices(form, choices)
    once, twice = OpCosts(nc, real), OpCosts(nc, again)
    compute = 0.0
    at = {r: i for i, r in enumerate(form.roots)}
    replayed_s = [0.0] * len(form.roots)   # per ILP node: its forward run again in backward
    for node in nc.graph.nodes:
        choice = nc.choices[node.name][idx[node.name]]
        compute += twice.compute_cost(node, choice) - once.compute_cost(node, choice)
        if again.replays(node.name) and nc.root_of[node.name] in at:
            replayed_s[at[nc.root_of[node.name]]] += once.pass_times(node, choice)[0]
    # The replay lengthens the backward that communication overlaps (`overlap_terms`).
    hidden_more = 0.0
    for term in form.problem.overlap:
        hidden, window = term.chosen(choices)
        hidden_more += term.saved(hidden, [w + r for w, r in zip(window, replayed_s)]) \
            - term.saved(hidden, window)
    return comm + compute - hidden_more


def _count_recipe(recipe: Recipe, needs_grad: bool, ctx: CostContext, counts: Counter,
                  comm: Counter, reshard: Counter, value: str, consumer: str) -> None:
    """Collectives of one moved value and their cost, owned by the op whose partial sums they
    reduce or by the consumer they bring the value to."""
    for step in recipe.steps:
        owner = comm if step.op in ("all_reduce", "reduce_scatter") else reshard
        for kind, phase in step.collectives(needs_grad):
            # The runtime moves a value while lowering its consumer (`lower/program.py`),
            # so the move is replayed where the consumer is.
            for label, n in ctx.phase_counts(phase, consumer):
                counts[(kind, step.nbytes, step.axes, label,
                        value if owner is comm else consumer)] += n
        owner[value if owner is comm else consumer] += step_cost(step, needs_grad, ctx.mesh,
                                                                 ctx.weights_of(consumer))


def _params(form: Formulation, idx: dict[str, int], sync: dict[str, list[tuple[int, ...]]],
            sfb: dict[str, tuple[int, ...]], counts: Counter
            ) -> tuple[tuple[ParamDecision, ...], dict[str, list[ov.GroupParam]]]:
    """The parameters' decisions, their collectives counted except those of the groups the
    runtime makes; the synchronized parameters by mode, for `_sync` ("replicated" buckets,
    "zero3" units; "zero2" for its reduce-scatters' timing)."""
    nc, g = form.choices, form.choices.graph
    shape = tuple(form.ctx.mesh.shape)
    uses = ov.param_uses(g)
    # ZeRO-2 gathers its new values after the update, bucketed per axes
    # (`ov.update_gather_buckets`).
    gathered: dict[tuple[int, ...], list[tuple[str, int]]] = {}
    grouped: dict[str, list[ov.GroupParam]] = {"replicated": [], "zero2": [], "zero3": []}
    out = []
    shapes: list[tuple[int, ...]] = []
    dims: list[tuple[tuple[int, ...], ...]] = []
    for n in g.params():
        choice = nc.choices[n.name][idx[n.name]]
        axes, backward = param_sync(sync.get(n.name, ()))
        mode = choice.mode if axes else "replicated"
        spec = choice.strategy.output
        if n.name in sfb:   # its gradient computed whole from gathered factors: no sync
            out.append(ParamDecision(n.state_name or n.name, n.name, spec.spec(), spec.spec(),
                                     "sfb", sfb[n.name]))
            shapes.append(n.out.shape)
            dims.append(update_dims(spec.dims, "replicated", ()))
            continue
        nbytes = local_bytes(n, spec, shape)
        for extra in backward:  # uses synchronized apart from the update (`param_sync`)
            counts[("all_reduce", nbytes, extra, "backward", n.name)] += form.ctx.microbatches
        if axes and n.name in uses:
            grouped[mode].append(ov.GroupParam(n.name, n.state_name or n.name, axes,
                                               n.out.dtype, nbytes, uses[n.name]))
        if axes and mode == "zero2":   # reduce-scattered one by one, gathered bucketed
            for kind, phase, count in zero_counts(mode, form.ctx, n.kept is not False):
                if phase == "update":
                    gathered.setdefault(axes, []).append((n.out.dtype, nbytes))
                else:
                    counts[(kind, nbytes, axes, phase, n.name)] += count
        out.append(ParamDecision(n.state_name or n.name, n.name, spec.spec(),
                                 storage_layout(spec, mode, axes).spec(), mode, axes))
        shapes.append(n.out.shape)
        dims.append(update_dims(spec.dims, mode, axes))
    for axes, ps in gathered.items():
        for b in ov.update_gather_buckets([d for d, _ in ps], [b for _, b in ps]):
            counts[("all_gather", sum(ps[i][1] for i in b), axes, "update", "")] += 1
    if form.ctx.optimizer.factored:  # its statistics completed over the shards (runtime's)
        for b in factored_buckets(shapes, dims, shape):
            counts[("all_reduce", 4 * b.numel, b.axes, "update", "")] += 1
    return tuple(out), grouped


def _sync_counts(form: Formulation, grouped: dict[str, list[ov.GroupParam]], counts: Counter
                 ) -> tuple[list, list]:
    """Gradient buckets and ZeRO-3 units (`lower/overlap.py`), their collectives counted."""
    buckets = ov.grad_buckets(grouped["replicated"])
    for b in buckets:
        counts[("all_reduce", b.bytes, b.axes, "update", "")] += 1
    units = ov.zero3_units(grouped["zero3"])
    kept = {n.name: n.kept is not False for n in form.choices.graph.params()}
    for u in units:
        for kind, phase, count in zero_counts("zero3", form.ctx, any(kept[p] for p in u.params)):
            counts[(kind, u.bytes, u.axes, phase, u.params[0])] += count
    return buckets, units


def _sync(form: Formulation, grouped: dict[str, list[ov.GroupParam]],
          times: list[tuple[float, float]], buckets: list, units: list) -> Sync:
    """Where each overlapped collective of the buckets and ZeRO-3 units falls on its pass:
    forward times from the start of the forward, backward times from the start of the
    backward (after the forward's replay when recomputed), each op's backward running in
    reverse order."""
    g, ctx = form.choices.graph, form.ctx
    fwd_at, bwd_done = [0.0], [0.0] * (len(times) + 1)
    for f, _ in times:
        fwd_at.append(fwd_at[-1] + f)
    replay = sum(t[0] for n, t in zip(g.nodes, times) if ctx.replays(n.name)) \
        if ctx.recompute else 0.0
    for i in range(len(times) - 1, -1, -1):     # backward of node i done
        bwd_done[i] = bwd_done[i + 1] + times[i][1]
    bwd_done = [replay + t for t in bwd_done]
    uses = {q.node: q.use for qs in grouped.values() for q in qs}
    entries: list[AsyncEntry] = []

    ready = [bwd_done[min(uses[p].first for p in b.params)] for b in buckets]
    for (k, at), b in zip(ov.launched(range(len(buckets)), ready), buckets):
        entries.append(AsyncEntry("all_reduce", b.bytes, b.axes, "last_backward", at))
    # ZeRO-2 gradients: reduce-scattered from their hooks as they complete, drained when the
    # backward ends.
    for p in sorted(grouped["zero2"], key=lambda q: -q.use.first):
        entries.append(AsyncEntry("reduce_scatter", p.nbytes, p.axes, "backward",
                                  bwd_done[p.use.first]))
    kept = {n.name: n.kept is not False for n in g.params()}
    regather, scatter = ov.unit_orders(units, uses, kept.__getitem__)
    if ctx.recompute:
        if ctx.recomputed is not None and units:
            raise NotImplementedError(
                "ZeRO-3 with a partial recomputation (selective, or some layers) is not "
                "supported yet: recompute every layer ('full') or use ZeRO-2")
        regather = ()   # the forward's replay gathers them
    first = [min(uses[p].first for p in u.params) for u in units]
    for i, at in ov.prefetched(range(len(units)), [fwd_at[f] for f in first], ov.PREFETCH):
        u = units[i]
        entries.append(AsyncEntry("all_gather", u.bytes, u.axes, "forward", at,
                                  fwd_at[first[i]]))
    need = [bwd_done[max(uses[p].last for p in units[i].params) + 1] for i in regather]
    for (i, at), wait in zip(ov.prefetched(regather, need, ov.PREFETCH), need):
        u = units[i]
        entries.append(AsyncEntry("all_gather", u.bytes, u.axes, "backward", at, wait))
    done = [bwd_done[first[i]] for i in scatter]
    for i, at in ov.launched(scatter, done):
        u = units[i]
        entries.append(AsyncEntry("reduce_scatter", u.bytes, u.axes, "backward", at))
    return Sync(buckets, units, regather, scatter, ov.PREFETCH, tuple(entries))


