"""What a recomputed program replays: segments of IR nodes, each checkpointed on its own.

A recomputation choice (a plan's or a pipeline stage's ``recompute``, ``recompute_scope``,
``recompute_layers``) is turned here into one map, node name -> segment, holding exactly the
nodes whose forward runs again in backward. The planner prices that map (compute, forward
collectives and memory of the replayed nodes only: `CostContext.recomputed`,
`liveness.segmented_peaks`, the ILP's live sets) and the runtime checkpoints it
(`runtime/step_modes.segmented`), so what is priced is what runs. The choices:

- ``scope="layers"``: each clustered layer is a segment (Megatron-LM's full recomputation);
  ``recompute_layers=k`` replays only the first k layers of the stage (Megatron-LM's
  ``--recompute-num-layers`` with its "block" method), the rest keep their activations.
- ``scope="attention"``: only each attention core is a segment (Megatron-LM's selective
  recomputation, Korthikanti et al. 2022): the scores ``q·kᵀ``, what scales, masks, softmaxes
  and drops them, and their product with ``v``. Those hold the O(seq²) activations per head
  and cost few FLOPs; their inputs q, k, v and the mask are kept, their output is the
  context. A fused attention (``sdpa``: flash attention) keeps no scores, so it has no core.

A core is found on the IR, not by module names: an activation-by-activation matmul ``B`` (both
operands carry the batch) whose first operand comes, through ops that are not matmuls, from
another such matmul ``A``; the core is A, B and every node on a path between them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from meshplan.ir.graph import Graph

SCOPES = ("layers", "attention")
MODES = ("none", "full", "selective", "auto", "layers:K")
MATMULS = frozenset({"matmul", "bmm", "mm"})
_HEAVY = MATMULS | {"conv", "sdpa"}


def check_scope(scope: str) -> str:
    if scope not in SCOPES:
        raise ValueError(f"unknown recomputation scope {scope!r}; valid: {list(SCOPES)}")
    return scope


@dataclass(frozen=True)
class Replay:
    """What a recomputed program (or stage) replays: ``scope`` "layers" (the first ``layers``
    of its clustered layers, None: all) or "attention" (its attention cores)."""

    scope: str = "layers"
    layers: int | None = None

    def __post_init__(self) -> None:
        check_scope(self.scope)
        if self.layers is not None and (self.scope != "layers" or isinstance(self.layers, bool)
                                        or not isinstance(self.layers, int) or self.layers < 1):
            raise ValueError(f"recompute_layers={self.layers!r}: a count of layers >= 1, "
                             "with scope 'layers' only")

    @property
    def whole(self) -> bool:
        """Every layer replayed: Megatron-LM's full recomputation."""
        return self.scope == "layers" and self.layers is None

    def describe(self) -> str:
        if self.scope == "attention":
            return "selective (attention cores)"
        return "every layer" if self.layers is None else f"the first {self.layers} layers"

    def segments(self, graph: Graph, layer_of: Mapping[str, int], start: int | None = None
                 ) -> dict[str, int]:
        return recomputed_segments(graph, layer_of, self.scope, self.layers, start)


class NoReplayError(ValueError):
    """A recomputation that does not apply to the program or plan it was asked of (no
    attention core to replay; a partial replay with ZeRO-3): "auto" tries the next one."""


def replay_text(holder: object) -> str:
    """How a plan or stage (its ``recompute``, ``recompute_scope``, ``recompute_layers``)
    recomputes, for people: "" when it does not."""
    if not getattr(holder, "recompute", False):
        return ""
    return "recomputed: " + Replay(getattr(holder, "recompute_scope", "layers"),
                                   getattr(holder, "recompute_layers", None)).describe()


FULL = Replay()
SELECTIVE = Replay("attention")


def parse_recompute(recompute: str) -> tuple[str, Replay]:
    """``(mode, replay)`` of a ``recompute`` argument: "none", "full" (every layer, as
    Megatron-LM's full recomputation), "selective" (attention cores only, as its selective
    recomputation), "layers:K" (the first K layers of each stage) or "auto" (the planner
    chooses per stage where memory demands it). Raises ValueError naming the valid forms."""
    if isinstance(recompute, str) and recompute.startswith("layers:"):
        count = recompute.partition(":")[2]
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"recompute={recompute!r}: 'layers:K' takes a count K >= 1 of "
                             "each stage's first layers to recompute")
        return "full", Replay("layers", int(count))
    modes = {"none": FULL, "full": FULL, "auto": FULL, "selective": SELECTIVE}
    if recompute not in modes:
        raise ValueError(f"recompute must be one of {list(MODES)}, got {recompute!r}")
    return ("full" if recompute == "selective" else recompute), modes[recompute]


def attention_cores(graph: Graph) -> list[frozenset[str]]:
    """Each attention core of ``graph`` (module docstring) as its node names, in graph order."""
    from meshplan.planner.intra.choices import batch_dims
    batched = batch_dims(graph)
    by = graph.by_name

    def activation_matmul(name: str) -> bool:
        n = by[name]
        return n.role == "op" and n.op in MATMULS and len(n.inputs) == 2 and all(
            batched.get(x) for x in n.inputs)

    cores = []
    for b in graph.nodes:
        if not activation_matmul(b.name):
            continue
        # Back from B's first operand through light ops, to the scores' matmul A.
        seen, stack, found = set(), [b.inputs[0]], []
        while stack:
            x = stack.pop()
            if x in seen or by[x].is_source:
                continue
            seen.add(x)
            if activation_matmul(x):
                found.append(x)
            elif by[x].op not in _HEAVY:
                stack.extend(by[x].inputs)
        if len(found) != 1:
            continue
        a = found[0]
        core = {a, b.name}
        # The nodes of `seen` that A reaches: the paths from A to B.
        for n in graph.nodes:
            if n.name in seen and n.name != a and any(x in core for x in n.inputs):
                core.add(n.name)
        cores.append(frozenset(core))
    return cores


def recomputed_segments(graph: Graph, layer_of: Mapping[str, int], scope: str = "layers",
                        first_layers: int | None = None, start: int | None = None
                        ) -> dict[str, int]:
    """Node name -> segment for every node ``graph`` replays (module docstring). ``layer_of``:
    each node's clustered layer; ``first_layers``: replay only the layers ``start`` ..
    ``start + first_layers - 1`` (``start``: the first layer ``graph`` holds), None: all."""
    check_scope(scope)
    if scope == "attention":
        return {name: k for k, core in enumerate(attention_cores(graph)) for name in core}
    # The first layer the graph computes: its ops' (a stage's received values and the
    # parameters it reads may belong to earlier layers, where nothing is replayed).
    layers = [layer_of[n.name] for n in graph.nodes if n.role == "op" and n.name in layer_of]
    first = min(layers, default=0) if start is None else start
    # A node the clustering does not know (a stage's received value, what it sends on) is in
    # its latest input's layer, or the first.
    where: dict[str, int] = {}
    for n in graph.nodes:
        where[n.name] = layer_of.get(n.name, max((where[x] for x in n.inputs if x in where),
                                                 default=first))
    return {name: layer for name, layer in where.items()
            if first_layers is None or layer < first + first_layers}
