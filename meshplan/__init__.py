"""meshplan: automatic parallelization of PyTorch training (Alpa's intra-op ILP, natively).

Front doors: ``meshplan.plan(model, loss_fn, optimizer, example_batch, cluster)`` returns a
`Plan`; ``meshplan.load_plan(path)`` reads one back; on each rank ``meshplan.parallelize(model,
optimizer, plan, loss_fn)`` runs a plan under the user's own training loop (a `Trainer` is the
same as one object), and ``launch`` starts local worker processes. The command line is ``meshplan plan ...``.
"""

from meshplan.cost.cluster import Cluster, parse_cluster_spec
from meshplan.errors import InfeasiblePlanError, WorkerError
from meshplan.plan.plan import Plan, load_plan
from meshplan.runtime.checkpoint import load_checkpoint, load_model_state, save_checkpoint
from meshplan.runtime.launcher import launch
from meshplan.runtime.parallel import parallelize
from meshplan.runtime.trainer import Trainer
from meshplan.api import plan  # last: the function, not the `meshplan.plan` subpackage

__all__ = ["Cluster", "InfeasiblePlanError", "Plan", "Trainer", "WorkerError", "launch",
           "load_checkpoint", "load_model_state", "load_plan", "parallelize", "parse_cluster_spec",
           "plan", "save_checkpoint"]
