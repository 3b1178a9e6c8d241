"""Typed exceptions that callers catch (STYLE §10); user-input errors stay ValueError/TypeError."""


class InfeasibleIlpError(ValueError):
    """No strategy assignment satisfies an ILP's constraints.

    Raised by ``meshplan.planner.intra.ilp.solve`` when every strategy of some node is forbidden,
    when forbidden pairs, aliases, the memory budget or ``max_cost`` exclude every assignment.
    """


class IlpCutOffError(InfeasibleIlpError):
    """No assignment of an ILP costs at most the ``cutoff`` its solve was given (the caller
    already holds a better answer elsewhere); raised by ``solve`` instead of an answer."""


class NodeLimitError(RuntimeError):
    """A solve told to stop at its node limit (``solve(..., search_on=False)``) reached it
    without a feasible point and without proving there is none: nothing is known either way."""


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
        if min_memory_bytes == float("inf"):   # not a matter of memory: nothing was found
            super().__init__("no plan exists at any memory budget: "
                             + (advice or "the method's restrictions leave none"))
            return
        super().__init__(
            f"no plan fits a memory budget of {budget_bytes / 2**30:.3f} GiB per device; the "
            f"smallest plan needs {min_memory_bytes / 2**30:.3f} GiB per device "
            f"({min_memory_bytes:.0f} bytes). "
            + (advice or "Raise the budget, use more devices, or a smaller batch"))

    def __reduce__(self) -> tuple:
        # Made again from what it was made of (a plan searched in a child raises it here).
        return type(self), (self.budget_bytes, self.min_memory_bytes, self.advice)


class MicrobatchError(ValueError):
    """The model cannot run on the micro-batch a count of micro-batches gives: fewer samples
    than it takes (batch norm over one value per channel, a reshape that fixes the batch).
    Raised in place of the model's own error (its ``__cause__``) where the count is more than
    one, so a search over counts can pass over it; ``count`` micro-batches of ``samples``
    samples each."""

    def __init__(self, count: int, samples: int, cause: BaseException) -> None:
        super().__init__(
            f"the model does not run on micro-batches of {samples} sample"
            f"{'s' * (samples != 1)} ({count} micro-batches): {type(cause).__name__}: "
            f"{cause}; give fewer micro-batches or a larger batch")
        self.count = count
        self.samples = samples


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

    def __reduce__(self) -> tuple:
        return type(self), (self.args[0], self.device_memory, self.min_memory_bytes)


class StepFailed(RuntimeError):
    """A training step failed on some rank; every rank of the run raises this same error
    (`meshplan.runtime.failure`).

    ``rank`` is the rank whose exception failed the step (the lowest one if several raised;
    ``also`` the others; None when no rank raised but ``silent`` ranks never answered within
    ``waited_s`` seconds),
    ``step`` its step number, ``error_type``/``message``/``trace`` that exception.
    ``recoverable``: no rank had begun its update, so the step was undone on every rank and
    the next step can run; otherwise the ranks' parameters may differ and the trainer refuses
    further steps. ``world_formed``: torch.distributed's world was formed again (false when
    a rank never answered).
    """

    def __init__(self, *, rank: int | None, step: int, error_type: str, message: str,
                 trace: str, recoverable: bool, also: tuple[int, ...] = (),
                 silent: tuple[int, ...] = (), waited_s: float = 0.0,
                 world_formed: bool = True) -> None:
        self.rank, self.step, self.error_type, self.message = rank, step, error_type, message
        self.trace, self.recoverable, self.also = trace, recoverable, also
        self.silent, self.waited_s, self.world_formed = silent, waited_s, world_formed
        super().__init__(self.__str__())

    def __reduce__(self):
        return _rebuild_step_failed, (dict(self.__dict__),)

    def summary(self) -> str:
        if self.rank is None:
            return (f"step {self.step} failed: rank(s) {list(self.silent)} made no progress "
                    f"for {self.waited_s:g} s (the process hangs, died, or left the training "
                    "loop): its peers timed out waiting for it")
        more = f" (also raised on rank(s) {list(self.also)})" if self.also else ""
        return (f"step {self.step} failed on rank {self.rank}: {self.error_type}: "
                f"{self.message}{more}")

    def __str__(self) -> str:
        if self.recoverable:
            then = ("every rank undid the step (gradients dropped, parameters and optimizer "
                    "state as before it): the next step can run")
        elif self.world_formed:
            then = ("some rank had begun its update, so the ranks' parameters may differ: "
                    "restore the last checkpoint")
        else:
            then = "the run cannot go on: restart it from the last checkpoint"
        trace = f"\n--- traceback of rank {self.rank} ---\n{self.trace}" if self.trace else ""
        return f"{self.summary()}; {then}{trace}"


def _rebuild_step_failed(state: dict) -> StepFailed:
    out = StepFailed.__new__(StepFailed)
    out.__dict__.update(state)
    RuntimeError.__init__(out, str(out))
    return out
