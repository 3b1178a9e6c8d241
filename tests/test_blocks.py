"""Repeated blocks share ILP decisions; on small models the shared optimum is the unshared one."""

from __future__ import annotations

import pytest

from meshplan.capture.to_ir import capture
from meshplan.cost.cluster import parse_cluster_spec
from meshplan.cost.mesh import logical_mesh
from meshplan.planner.intra.blocks import repeated_blocks
from meshplan.planner.intra.choices import IntraOptions, resolve_choices
from meshplan.planner.intra.formulate import CostContext, formulate
from meshplan.planner.intra.ilp import solve
from meshplan.zoo.spec import build_workload

SMALL = {
    "gpt": ("gpt:hidden=256,layers=4,heads=8,seq=128,vocab=1024,batch=16", 0.0),
    "moe": ("moe:hidden=64,layers=4,heads=4,experts=8,seq=32,vocab=256,batch=8", 0.0),
    "wresnet": ("wresnet:layers=50,channels=8,width=2,image=32,classes=10,batch=16", 0.01),
    "mlp": ("mlp:layers=8,hidden=256,batch=32", 0.0),
}


def _solve(spec: str, share: bool) -> tuple[float, int]:
    w = build_workload(spec)
    _, graph = capture(w.model, w.loss_fn, w.example_batch)
    cluster = parse_cluster_spec("p3.16xlarge:1")
    choices = resolve_choices(graph, (2, 4), IntraOptions())
    form = formulate(choices, CostContext(logical_mesh(cluster, (2, 4)), cluster.device), None,
                     share_blocks=share)
    sol = solve(form.problem)
    return sol.objective, sol.num_variables


@pytest.mark.parametrize("name", list(SMALL))
def test_shared_blocks_reach_the_unshared_optimum_with_fewer_variables(name: str) -> None:
    spec, slack = SMALL[name]
    free, free_vars = _solve(spec, share=False)
    shared, shared_vars = _solve(spec, share=True)
    assert free <= shared * (1 + 1e-9)  # sharing only restricts
    assert shared <= free * (1 + slack + 1e-9)
    assert shared_vars < free_vars


def test_a_transformer_layer_is_found_from_structure() -> None:
    w = build_workload("gpt:hidden=64,layers=6,heads=4,seq=16,vocab=128,batch=2")
    _, graph = capture(w.model, w.loss_fn, w.example_batch)
    groups = repeated_blocks(graph)
    repeats = {len(g) for g in groups}
    assert 3 in repeats  # six layers: three pairs of layers
    # Each group ties the same op of every repeat: same op, same shape.
    for g in groups:
        nodes = [graph.nodes[i] for i in g]
        assert len({(n.op, n.out.shape) for n in nodes}) == 1
