"""meshplan: automatic parallelization of PyTorch training (Alpa's intra-op ILP, natively).

Front doors: ``meshplan.plan(model, loss_fn, optimizer, example_batch, cluster)`` returns a
`Plan`; ``meshplan.load_plan(path)`` reads one back; on each rank ``meshplan.parallelize(model,
optimizer, plan, loss_fn)`` runs a plan under the user's own training loop (a `Trainer` is the
same as one object), and ``launch`` starts local worker processes; ``meshplan.at_shape(plan,
model, loss_fn, batch)`` prices a plan at another batch shape. The command line is ``meshplan plan ...``.

The planner, the runtime and checkpoints are imported when first used (each process a launcher
starts pays only for what it runs: the solver and torch's checkpointing are a second of
imports).
"""

import importlib
from typing import Any

from meshplan.cost.cluster import Cluster, parse_cluster_spec
from meshplan.errors import InfeasiblePlanError, WorkerError
from meshplan.plan.plan import Plan, load_plan

# Importing the `meshplan.plan` subpackage bound its name here; `meshplan.plan` is the
# planning function (`__getattr__`), the subpackage stays `sys.modules["meshplan.plan"]`.
del plan  # noqa: F821 — bound by the import above

_LAZY = {
    "plan": "meshplan.api",
    "at_shape": "meshplan.planner.intra.at_shape",
    "parallelize": "meshplan.runtime.parallel",
    "Trainer": "meshplan.runtime.trainer",
    "launch": "meshplan.runtime.launcher",
    "save_checkpoint": "meshplan.runtime.checkpoint",
    "load_checkpoint": "meshplan.runtime.checkpoint",
    "load_model_state": "meshplan.runtime.checkpoint",
}


def __getattr__(name: str) -> Any:
    if name == "data":   # rank-local loading (`meshplan/data.py`), a module of its own
        return importlib.import_module("meshplan.data")
    if name not in _LAZY:
        raise AttributeError(f"module 'meshplan' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


__all__ = ["Cluster", "InfeasiblePlanError", "Plan", "Trainer", "WorkerError", "at_shape",
           "launch", "load_checkpoint", "load_model_state", "load_plan", "parallelize",
           "parse_cluster_spec", "plan", "save_checkpoint"]
