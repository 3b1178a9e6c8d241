"""The training loop PyTorch users already write, running a plan: ``parallelize``.

On every rank::

    model, optimizer = meshplan.parallelize(model, optimizer, plan, loss_fn)
    for batch in batches:              # the global batch, the same on every rank
        loss = model(batch)            # this rank's share of the step, the global loss's value
        loss.backward()
        model.clip_grad_norm_(1.0)     # optional: the global norm, as one device clips
        optimizer.step()
        optimizer.zero_grad()

The model returned runs this rank's local program (`Trainer`) on its share of the batch (the
"data helper": every rank passes the global batch, each takes its own rows as the plan splits
them, uneven shares included) and returns the loss. The optimizer returned is the user's own
object: its parameter groups keep their hyper-parameters (weight decay per group, a scheduler's
learning rate) and now hold this rank's update tensors (a shard under ZeRO), its state starts
afresh; a step-pre hook synchronizes the gradients first (bucketed all-reduce, ZeRO's
reduce-scatters having run in backward) and clips them if the plan's optimizer says so, a post
hook refreshes ZeRO-2's compute copies. A plan of several micro-batches runs the first ones'
forward and backward inside the call (accumulating their gradients, one micro-batch's
activations held at a time, as planned) and leaves the last one's backward to
``loss.backward()``. A pipeline's call runs its whole schedule (forwards and backwards
interleaved, as 1F1B must), so ``loss.backward()`` has nothing left to do; ``optimizer.step()``
then synchronizes every stage's gradients (shared parameters summed across stages, the norm
taken over all) and steps each of this rank's stages. In evaluation mode (``model.eval()``) a
call returns the loss of the model in evaluation mode (`ParallelModel._evaluated`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from meshplan.capture.batch import flatten_batch, whole_loss
from meshplan.capture.memo import captured_in_mode
from meshplan.capture.trace import uncompiled
from meshplan.plan.plan import Plan
from meshplan.runtime.comm import Comm, ProcessGroupComm
from meshplan.runtime.failure import StepGuard
from meshplan.runtime.grad_norm import check_clip_args
from meshplan.runtime.devices import check_backend, resolve_device
from meshplan.runtime.p2p import P2P, ProcessGroupP2P
from meshplan.runtime.pipeline import PipelineTrainer
from meshplan.runtime.run_script import init_world
from meshplan.runtime.step_modes import autocast_for
from meshplan.runtime.trainer import Trainer, locked_capture, shape_key


# What a parallel model answers for its parameters: its ranks' shards live in the trainers, so
# torch.nn.utils.clip_grad_norm_(model.parameters()) would see nothing and clip nothing.
_NO_PARAMETERS = (
    "a parallel model's parameters are its ranks' shards, held by the plan's trainers: clip "
    "gradients with model.clip_grad_norm_(max_norm) (the global norm over every rank, as "
    "FSDP's) or the plan's optimizer (OptimizerSpec(..., max_grad_norm=1.0)), clear them "
    "with optimizer.zero_grad() or model.zero_grad(), read them whole with "
    "model.full_state_dict() or a checkpoint; the model given to parallelize keeps its "
    "initial values")


# What a parallel model answers for ``state_dict()``: nn.Module's would be empty (the state is
# the trainers'), and a whole one gathers over every rank, which a call on one rank only (as
# DDP users save) would wait on forever.
_NO_STATE_DICT = (
    "a parallel model's state is its ranks' shards: model.full_state_dict() gathers it whole "
    "(call it on every rank, save it from one), meshplan.save_checkpoint(path, model, "
    "optimizer) saves it resumable; model.load_state_dict(a whole state) loads one")


class ParallelModel(nn.Module):
    """``model(batch) -> loss`` on this rank under the plan (module docstring). Its trainer is
    built at the first call, from that batch's shapes (the plan's)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, plan: Plan,
                 loss_fn: Callable | None, comm: Comm, p2p: P2P | None = None,
                 captured: Any = None, local_example: Any = None) -> None:
        super().__init__()
        # Rank-local loading: the global example batch the trainer is built from, each call
        # then given this rank's rows only (`meshplan.data`).
        self._local_example = local_example
        self._model, self._optimizer, self._plan = [model], optimizer, plan
        self._loss_fn, self._comm, self._p2p, self._captured = loss_fn, comm, p2p, captured
        self._trainer: Trainer | None = None
        self._pipeline: PipelineTrainer | None = None
        # A pipeline's step runs its backward in the schedule: the loss returned hangs on
        # this leaf only, so the caller's loss.backward() has nothing left to do.
        self._anchor = torch.zeros((), requires_grad=True, device=comm.device)
        self._pending: tuple[str, torch.optim.Optimizer | None] | None = None  # a checkpoint
        self._pending_state: dict[str, torch.Tensor] | None = None   # `load_state_dict`
        # Calls whose last backward the caller has yet to run (`clip_grad_norm_` waits; a
        # call made while one is due runs without overlapping its all-reduce); of those, the
        # calls that ran part of their backward inside (earlier micro-batches, a pipeline's
        # schedule), whose gradients a step would take though their backward never ran.
        self._backwards_due = 0
        self._eager_due = 0
        # ``model.eval()``: whether the model computes the training program in evaluation mode
        # too, by batch shape; and the whole model evaluation runs where it does not.
        self._same_in_eval: dict[tuple, bool] = {}
        self._eval_model: nn.Module | None = None

    def _start(self, batch: Any) -> None:
        model, plan = self._model[0], self._plan
        if plan.num_stages > 1:
            assert self._p2p is not None
            local = self._local_example is not None
            self._pipeline = PipelineTrainer(plan, model, self._loss_fn,
                                             self._local_example if local else batch,
                                             self._comm, self._p2p, captured=self._captured,
                                             local_batches=local)
            trainers = list(self._pipeline.trainers.values())
            prepare, guard = self._pipeline.prepare_gradients, self._pipeline.guard
            settled = self._pipeline.settled
        else:
            local = self._local_example is not None
            tr = Trainer(plan, model, self._loss_fn, self._local_example if local else batch,
                         self._comm, captured=self._captured, local_batches=local)
            self._trainer, trainers, prepare, guard = tr, [tr], tr.prepare_gradients, tr.guard
            settled = tr.settled
        engine_settled, engine_prepare = settled, prepare

        def settled() -> None:   # a loss whose backward never ran is not due past the step
            self._backwards_due = self._eager_due = 0
            self._eval_model = None   # (a step in evaluation mode: gathered again)
            engine_settled()

        def prepare() -> None:
            self._check_no_eager_due()
            engine_prepare()
        _repoint(self._optimizer, model, trainers, prepare, settled, guard)
        _hook_grad_scaler()
        self._optimizer._meshplan_unscale = self._unscaled   # type: ignore[attr-defined]
        if self._pending is not None:   # `load_checkpoint` before the first call
            from meshplan.runtime.checkpoint import apply_checkpoint
            apply_checkpoint(self._pending[0], self, self._pending[1])
            self._pending = None
        if self._pending_state is not None:   # `load_state_dict` before the first call
            for t in trainers:
                t.load_state(self._pending_state)
            self._pending_state = None

    def forward(self, batch: Any) -> torch.Tensor:
        if self._trainer is None and self._pipeline is None:
            self._start(batch)
        if not self.training and not self._computes_alike_in_eval(batch):
            return self._evaluated(batch)
        if self._pipeline is not None:
            value = self._pipeline.step(batch, apply=False)
            whole = torch.as_tensor(value, dtype=self._anchor.dtype, device=self._anchor.device)
            if not torch.is_grad_enabled():
                return whole
            return self._due(whole, self._pipeline.scale_loss, eager=True)
        tr = self._trainer
        assert tr is not None
        tr.serve(batch)
        with tr.guard.running():
            rng = tr.begin_step()
            micro = tr.split(batch)
            scales = tr.step_scales(micro)
            done = []
            for k, (piece, scale) in enumerate(zip(micro[:-1], scales)):   # the last backward
                loss = tr.run_microbatch(piece, rng, scale, k)                # is the caller's
                if torch.is_grad_enabled():
                    (loss / len(micro) * tr.eager_scale()).backward()
                    tr.own_gradients()
                done.append(loss.detach())
            # The caller's loss.backward() is the step's last, unless an earlier call's is due
            # too (their losses summed, then one backward): then no bucket may be all-reduced
            # before both have run, and the step's synchronization reduces them all.
            if torch.is_grad_enabled() and not self._backwards_due:
                tr.last_backward()
            last = tr.run_microbatch(micro[-1], rng, scales[-1], len(micro) - 1) / len(micro)
            local = last.detach() + sum(d / len(micro) for d in done)
            whole = torch.tensor(tr._report(local), dtype=last.dtype, device=last.device)
        if not last.requires_grad:
            return whole
        # The value returned is the whole batch's loss; its backward runs this rank's part of
        # the last micro-batch's, guarded as the rest of the step.

        def backward(grad: torch.Tensor) -> None:
            with tr.guard.running():
                if done:   # the earlier ones ran at the eager scale: the step takes the
                    tr.scale_loss(grad)   # ratio of the loop's to it at once
                    grad = tr.eager_scale().to(last.dtype)   # (backward runs without grad
                torch.autograd.backward(last, grad)           # mode: a seed, not a product)
        return self._due(whole, backward, eager=bool(done))

    def _due(self, whole: torch.Tensor, backward: Callable[[torch.Tensor], None], eager: bool
             ) -> torch.Tensor:
        """``whole`` as the loss returned, whose ``loss.backward()`` runs ``backward``; the
        call is due until it does (``eager``: it ran part of its backward inside)."""
        self._backwards_due += 1
        self._eager_due += eager

        def run(grad: torch.Tensor) -> None:
            backward(grad)
            self._backwards_due = max(self._backwards_due - 1, 0)
            self._eager_due = max(self._eager_due - eager, 0)
        return _GuardedBackward.apply(self._anchor, whole, run)

    def _check_no_eager_due(self) -> None:
        """Raise RuntimeError where a call of this step whose loss was never backpropagated
        left gradients: one device's would add none."""
        if self._eager_due:
            raise RuntimeError(
                "optimizer.step() with the gradients of a call whose loss.backward() never "
                "ran: this plan runs part of each call's backward inside the call (its earlier "
                "micro-batches, a pipeline's schedule), so that call's gradients are already "
                "in the step's, where one device's would have none. Call loss.backward() on "
                "it, or optimizer.zero_grad() after a call you do not backpropagate (or make "
                "that call under torch.no_grad() or model.eval())")

    def train(self, mode: bool = True) -> "ParallelModel":
        """nn.Module's: in evaluation mode (``model.eval()``) a call returns the loss the model
        computes in evaluation mode, as one device's model does (`_evaluated`)."""
        if mode:
            self._eval_model = None   # the whole copy evaluation held, freed
        return super().train(mode)

    def _computes_alike_in_eval(self, batch: Any) -> bool:
        """Whether the model traces to the same program in evaluation mode as in the modes it
        trains in at ``batch``'s shape (no dropout, no batch norm, no branch on ``self.training``): then
        the plan's own program evaluates it, sharded as it trains."""
        probe = self._local_example if self._local_example is not None else batch
        key = shape_key(probe)
        if key not in self._same_in_eval:
            model, loss_fn = self._model[0], self._loss_fn
            trained = locked_capture(model, loss_fn, probe)[0]   # in the modes it trains in
            evaluated = captured_in_mode(model, loss_fn, probe, False)[0]
            self._same_in_eval[key] = trained.graph_module.code == evaluated.graph_module.code
        return self._same_in_eval[key]

    def _evaluated(self, batch: Any) -> torch.Tensor:
        """The loss of the model in evaluation mode on ``batch``, where that is another program
        than the plan's (dropout, batch norm's running statistics): the parameters and buffers
        gathered whole on every rank (`full_state_dict`) into a copy of the model in evaluation
        mode, which runs the whole batch on this rank's device without gradients, as one
        device would (a pipeline's stages send theirs to every rank: `whole_state`). The copy
        (a whole model per rank) is kept for the rest of the pass, until ``model.train()``, a
        step or a load changes the state."""
        if self._local_example is not None:
            raise NotImplementedError(
                "model.eval() where the model computes differently in evaluation mode (dropout, "
                "batch norm's running statistics) is not supported with rank-local batches "
                "yet: save a checkpoint (meshplan.save_checkpoint) and evaluate the model "
                "loaded from it, or evaluate with the global batch")
        device = self._comm.device
        with torch.no_grad(), autocast_for(self._plan.dtype, device.type):
            return whole_loss(self._whole_copy(), self._loss_fn, batch, device).detach()

    def _whole_copy(self) -> nn.Module:
        """The model whole on this rank's device, in evaluation mode, with the plan's state
        (gathered once per evaluation pass: nothing changes the state until ``train()``)."""
        if self._eval_model is None:
            state = self.full_state_dict()
            self._eval_model = copy.deepcopy(self._model[0]).to(self._comm.device)
            # Every parameter and every buffer the program reads; one it never reads is the
            # model's own, as it was given.
            self._eval_model.load_state_dict(state, strict=False)
            self._eval_model.eval()
        return self._eval_model

    def predict(self, batch: Any) -> Any:
        """What the model returns for ``batch``'s inputs (a target is ignored), as one
        device's model returns it in evaluation mode, without gradients: logits for the
        metrics of a validation pass beside its loss. Call it after ``model.eval()`` on every
        rank (the pass's first call gathers the state into a whole copy of the model on each
        rank, as the evaluation loss of a model with dropout does: a whole model's memory per
        rank until ``model.train()``); the inputs given are run whole (the global batch, or the
        rows a rank loaded). Raises RuntimeError in training mode."""
        if self.training:
            raise RuntimeError("predict runs the model in evaluation mode: call model.eval() "
                               "first (and model.train() before the next training step)")
        if self._trainer is None and self._pipeline is None:
            self._start(batch)
        layout, tensors = flatten_batch(batch)
        device = self._comm.device
        args, kwargs, _ = layout.call([t.to(device) for t in tensors.values()])
        with torch.no_grad(), autocast_for(self._plan.dtype, device.type):
            return self._whole_copy()(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DistributedDataParallel's context for the backwards of gradient accumulation's
        earlier batches, so that a loop written for DDP runs unchanged: here it changes
        nothing, as the gradients are synchronized once, at the optimizer's step."""
        yield

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model, as FSDP's method of this
        name: the gradients' global ``norm_type``-norm (every element counted once over the
        ranks and stages) is returned, the same on every rank, and every gradient scaled by
        ``max_norm / (norm + 1e-6)`` where that is below 1. Call it after ``loss.backward()``
        and before ``optimizer.step()``; it synchronizes the step's gradients (the optimizer's
        step then does not again), so the step's gradients must all be accumulated by then.
        Raises RuntimeError before the first call or while a backward is due, ValueError for
        a bad ``max_norm`` or ``norm_type``."""
        max_norm, norm_type = check_clip_args(max_norm, norm_type)
        engine = self._pipeline or self._trainer
        if engine is None:
            raise RuntimeError("the parallel model has no gradients yet: call it on a batch "
                               "and run loss.backward() before clip_grad_norm_")
        if self._backwards_due:
            raise RuntimeError("clip_grad_norm_ before loss.backward(): the step's last "
                               "backward has not run, its gradients would be left out of the "
                               "norm; call loss.backward() first")
        norm = engine.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)
        dtype = next((p.update.dtype for t in self._trainers() for p in t.params),
                     torch.float32)
        return norm.to(dtype)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The gradients of this rank's shards cleared, as ``optimizer.zero_grad()`` clears
        them (nn.Module's own would clear the parameters of nothing: the shards are the
        trainers', not this module's)."""
        self._optimizer.zero_grad(set_to_none=set_to_none)
        self._backwards_due = self._eager_due = 0
        for t in self._trainers():
            for p in t.params:
                if p.compute is not None and p.compute.grad is not None:
                    p.compute.grad = None if set_to_none else p.compute.grad.zero_()

    def parameters(self, recurse: bool = True) -> Any:
        raise TypeError(_NO_PARAMETERS)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(_NO_PARAMETERS)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(_NO_STATE_DICT)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True,
                        assign: bool = False) -> Any:
        """nn.Module's, for a whole state (the original model's ``state_dict()``, one device's
        or `full_state_dict`'s): each rank takes its pieces of every parameter and buffer, as
        it took the model's at the start; the optimizer's state is kept. Before the first call
        it is held until the model starts. ``strict`` as nn.Module's: RuntimeError naming the
        keys missing from ``state_dict`` or foreign to the model; ValueError for a tensor of
        another shape."""
        if assign:
            raise ValueError("load_state_dict(assign=True) would swap in the given tensors "
                             "whole; a parallel model's ranks hold pieces of them: load "
                             "with assign=False")
        expected = set(self._model[0].state_dict())
        missing = sorted(expected - set(state_dict))
        unexpected = sorted(set(state_dict) - expected)
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(self._model[0]).__name__}: "
                f"missing key(s) {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
                f"unexpected key(s) {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
        state = {k: v for k, v in state_dict.items() if k in expected}
        self._eval_model = None
        if self._trainer is None and self._pipeline is None:
            self._pending_state = state
        else:
            for t in self._trainers():
                t.load_state(state)
        return _IncompatibleKeys(missing, unexpected)

    def _unscaled(self, unscale: Callable[[], dict]) -> dict:
        """A GradScaler's ``unscale`` of this rank's update gradients (`_hook_grad_scaler`):
        first the step's gradients synchronized, as one device's are complete after backward;
        then its finding of an inf or NaN made the same on every rank (any rank's, of any
        stage), so that every rank skips the step alike and lowers its scale alike."""
        engine = self._pipeline or self._trainer
        assert engine is not None
        if self._backwards_due:
            raise RuntimeError("GradScaler.unscale_ (or step) before loss.backward(): the "
                               "step's last backward has not run; call "
                               "scaler.scale(loss).backward() first")
        with engine.guard.running():
            engine.synchronize_gradients()
            found = unscale()
            largest = self._pipeline.norm_total(math.inf) if self._pipeline is not None \
                else engine.norm_part(math.inf)
            if self._pipeline is not None:
                self._pipeline.p2p.wait_all()
        bad = float(not bool(torch.isfinite(largest)))
        for flag in found.values():
            flag.fill_(bad)
        return found

    def _trainers(self) -> list[Trainer]:
        if self._pipeline is not None:
            return list(self._pipeline.trainers.values())
        return [self._trainer] if self._trainer is not None else []

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer of the plan, each whole, by its name in the original
        model, on every rank (collective: every rank calls it). A pipeline's stages send theirs
        to the ranks of the others (`whole_state`), so a state saved from any one rank is the
        whole model's, as `_NO_STATE_DICT` tells users."""
        engine = self._pipeline or self._trainer
        if engine is None:
            raise RuntimeError("the parallel model has not run yet: call it on a batch first")
        if self._pipeline is None:
            return engine.full_state_dict()
        with engine.guard.running():
            return self._pipeline.whole_state()


def parallelize(model: nn.Module, optimizer: torch.optim.Optimizer, plan: Plan,
                loss_fn: Callable | None = None, *, comm: Comm | None = None,
                p2p: P2P | None = None, captured: Any = None,
                device: str | torch.device | None = None, local_batches: bool = False,
                example_batch: Any = None) -> tuple[ParallelModel, torch.optim.Optimizer]:
    """The model and optimizer of this rank under ``plan`` (module docstring). ``loss_fn`` is
    the plan's (None: the model returns its own loss). ``comm`` (this rank's stage mesh's
    communicator) and, for a pipeline, ``p2p`` default to the torch.distributed world
    (joined from the environment ``meshplan run`` or ``torchrun`` sets, `init_world`); ``captured``: a capture of the model at one
    micro-batch to reuse (ranks emulated as threads share one: tracing is not thread-safe).
    ``device`` is where this rank computes ("cpu", "cuda", "cuda:K"; default: ``cuda:LOCAL_RANK``
    when CUDA is available, else the CPU, `devices.resolve_device`); a given ``comm`` brings
    its own. The model's state, the optimizer's and each batch's share are moved there; the
    user's model object itself is left where it is. ``local_batches``: each call is given
    this rank's rows of the global batch only (`meshplan.data.LocalBatchSampler` loads them;
    a pipeline's rank only the tensors its stages read, None where it reads none),
    ``example_batch`` the global example batch the plan was made with.
    Raises TypeError for an optimizer that is not a torch optimizer, ValueError for one over
    other tensors or a ``device`` other than ``comm``'s, RuntimeError when no world is
    initialized and no ``comm`` is given, or the world's backend cannot reach the device."""
    if local_batches and example_batch is None:
        raise ValueError("local_batches=True needs example_batch=: the global example batch "
                         "the plan was made with")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer over the model's "
                        f"parameters, got {type(optimizer).__name__}")
    model = uncompiled(model)
    owned = {id(p) for p in model.parameters()}
    stray = [i for i, g in enumerate(optimizer.param_groups)
             if any(id(p) not in owned for p in g["params"])]
    if stray:
        raise ValueError(f"optimizer parameter group(s) {stray} hold tensors that are not "
                         "parameters of this model; give the optimizer of this model")
    if comm is not None and device is not None and resolve_device(device) != comm.device:
        raise ValueError(f"device={device!r} but the given comm computes on {comm.device}")
    if comm is None or (plan.num_stages > 1 and p2p is None):
        dev = comm.device if comm is not None else resolve_device(device)
        if not init_world(device=dev):
            raise RuntimeError("parallelize needs a torch.distributed world (launch with "
                               "`meshplan run` or `torchrun`) or an explicit comm= (and p2p= "
                               "for a pipeline)")
        ranks = len({d for s in plan.stages for d in s.devices}) if plan.num_stages > 1 \
            else plan.mesh_shape[0] * plan.mesh_shape[1]
        if torch.distributed.get_world_size() != ranks:
            raise ValueError(f"the plan runs on {ranks} processes, this world has "
                             f"{torch.distributed.get_world_size()}: launch it with "
                             f"--nproc {ranks} (or plan for this world)")
        check_backend(dev)
        if comm is None:
            comm = ProcessGroupComm.for_stages(plan.stage_meshes(), dev) \
                if plan.num_stages > 1 else ProcessGroupComm(plan.mesh_shape, dev)
        p2p = p2p or (ProcessGroupP2P(dev) if plan.num_stages > 1 else None)
    return ParallelModel(model, optimizer, plan, loss_fn, comm, p2p, captured,
                         example_batch if local_batches else None), optimizer


def _hook_grad_scaler() -> None:
    """torch's GradScaler (``torch.amp`` and ``torch.cuda.amp``) unscales, and checks for
    infs, the gradients its optimizer's parameters hold; a plan synchronizes them at the step,
    after the scaler has read them, and each rank holds only its shards, so the ranks could
    decide apart whether to skip the step. For an optimizer `parallelize` repointed, the
    scaler's unscaling runs through `ParallelModel._unscaled`; for any other, as it was.
    Installed once, at the first parallel model's first call."""
    cls = torch.amp.GradScaler
    original = cls._unscale_grads_
    if getattr(original, "_meshplan", False):
        return

    @functools.wraps(original)
    def unscale_grads(scaler: Any, optimizer: torch.optim.Optimizer, *args: Any,
                      **kwargs: Any) -> Any:
        own = getattr(optimizer, "_meshplan_unscale", None)
        if own is None:
            return original(scaler, optimizer, *args, **kwargs)
        return own(lambda: original(scaler, optimizer, *args, **kwargs))
    unscale_grads._meshplan = True   # type: ignore[attr-defined]
    cls._unscale_grads_ = unscale_grads   # type: ignore[method-assign]


class _GuardedBackward(torch.autograd.Function):
    """``value`` as a loss hanging on ``anchor`` whose backward is ``backward(grad)``: the
    caller's ``loss.backward()`` runs the step's last backward inside the step's guard."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, value: torch.Tensor,
                backward: Callable[[torch.Tensor], None]) -> torch.Tensor:
        ctx.run = backward
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.run(grad)
        return None, None, None


def _repoint(optimizer: torch.optim.Optimizer, model: nn.Module, trainers: list[Trainer],
             prepare: Callable[[], None], settled: Callable[[], None], guard: StepGuard
             ) -> None:
    """The user's optimizer, stepping this rank's update tensors (of every stage it runs): each
    group keeps its hyper-parameters; ``prepare`` runs before every step (synchronize, clip),
    ZeRO-2's compute copies are refreshed after and ``settled`` told (as on ``zero_grad``: the
    next gradients are synchronized anew); the whole step runs in ``guard`` (a failure
    on one rank fails it on every rank, `runtime/failure.py`)."""
    names = {id(p): n for n, p in model.named_parameters()}
    local: dict[str, list[torch.Tensor]] = {}
    for t in trainers:
        for p in t.params:
            local.setdefault(p.name, []).append(p.update)
    for group in optimizer.param_groups:
        group["params"] = [u for p in group["params"] for u in local.get(names[id(p)], ())]
    optimizer.state.clear()
    for t in trainers:
        t.optimizer = optimizer

    def after(*_: Any) -> None:
        for t in trainers:
            t._refresh_zero2()
        settled()

    def before(*_: Any) -> None:
        prepare()
        guard.updating = True   # from here a failure leaves the ranks apart

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)
    unguarded = optimizer.step

    @functools.wraps(unguarded)
    def step(*args: Any, **kwargs: Any) -> Any:
        with guard.running():
            return unguarded(*args, **kwargs)
    optimizer.step = step   # the instance's own: hooks and schedulers wrap it as usual
    unzeroed = optimizer.zero_grad

    @functools.wraps(unzeroed)
    def zero_grad(*args: Any, **kwargs: Any) -> Any:
        settled()   # gradients dropped unapplied (a step skipped): the next are new
        return unzeroed(*args, **kwargs)
    optimizer.zero_grad = zero_grad
