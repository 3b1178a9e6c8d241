"""meshplan: automatic parallelization of PyTorch training (Alpa's intra-op ILP, natively).

Front doors: ``meshplan.plan(model, loss_fn, optimizer, example_batch, cluster)`` returns a
`Plan`; ``meshplan.load_plan(path)`` reads one back; a `Trainer` runs a plan on one rank and
``launch`` starts local worker processes. The command line is ``meshplan plan ...``.
"""

from meshplan.cost.cluster import Cluster, parse_cluster_spec
from meshplan.errors import InfeasiblePlanError, WorkerError
from meshplan.plan.plan import Plan, load_plan
from meshplan.runtime.launcher import launch
from meshplan.runtime.trainer import Trainer
from meshplan.api import plan  # last: the function, not the `meshplan.plan` subpackage

__all__ = ["Cluster", "InfeasiblePlanError", "Plan", "Trainer", "WorkerError", "launch",
           "load_plan", "parse_cluster_spec", "plan"]
