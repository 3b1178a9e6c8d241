"""Typed exceptions that callers catch (STYLE §10); user-input errors stay ValueError/TypeError."""


class InfeasibleIlpError(ValueError):
    """No strategy assignment satisfies an ILP's constraints.

    Raised by ``meshplan.planner.intra.ilp.solve`` when every strategy of some node is forbidden,
    when forbidden pairs, aliases, the memory budget or ``max_cost`` exclude every assignment.
    """


class WorkerError(RuntimeError):
    """A worker process of a multi-process run failed: it raised, or died without a result.

    Raised by ``meshplan.runtime.launcher.launch`` and ``meshplan.runtime.pool.WorkerPool.run``.
    ``rank`` is the failing worker's rank, ``message`` a one-line summary (``"ValueError: ..."``
    or ``"process exited with code 3"``), ``traceback`` the worker's formatted traceback ("" if
    the process died without one).
    """

    def __init__(self, rank: int, message: str, traceback: str = "") -> None:
        super().__init__(rank, message, traceback)
        self.rank = rank
        self.message = message
        self.traceback = traceback

    def __str__(self) -> str:
        text = f"rank {self.rank} failed: {self.message}"
        if not self.traceback:
            return text
        return f"{text}\n--- traceback of rank {self.rank} ---\n{self.traceback}"


class InfeasiblePlanError(ValueError):
    """No plan fits the per-device memory budget.

    ``min_memory_bytes`` is the smallest per-device memory any plan on this mesh needs (by the
    memory model), so the caller can say what budget would work; ``advice`` says what would
    help, from what that smallest plan holds.
    """

    def __init__(self, budget_bytes: float, min_memory_bytes: float, advice: str = "") -> None:
        self.budget_bytes = budget_bytes
        self.min_memory_bytes = min_memory_bytes
        self.advice = advice
        super().__init__(
            f"no plan fits a memory budget of {budget_bytes / 2**30:.3f} GiB per device; the "
            f"smallest plan needs {min_memory_bytes / 2**30:.3f} GiB per device "
            f"({min_memory_bytes:.0f} bytes). "
            + (advice or "Raise the budget, use more devices, or a smaller batch"))


class NoPipelineError(ValueError):
    """No split of the layers into stages on submeshes covering the cluster is feasible.

    Raised by ``meshplan.planner.inter.stage_dp.solve_stage_dp`` (and its brute-force oracle).
    ``device_memory`` is the budget in bytes per device (None = unlimited); ``min_memory_bytes``
    the smallest per-device memory with which some pipeline would fit (``math.inf`` when the
    profile leaves no pipeline at all, whatever the memory).
    """

    def __init__(self, message: str, device_memory: float | None = None,
                 min_memory_bytes: float = float("inf")) -> None:
        super().__init__(message)
        self.device_memory = device_memory
        self.min_memory_bytes = min_memory_bytes
