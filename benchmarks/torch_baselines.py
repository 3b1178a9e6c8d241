"""PyTorch's own parallelisms of the zoo GPT, as `runtime_overhead.py` times them: DDP, FSDP2,
Megatron-style tensor parallelism (DTensor) and a 2-stage `torch.distributed.pipelining` 1F1B
pipeline (DDP over each stage's replicas when there are several).

Each builder takes this rank's copy of the model (built with the same seed on every rank) and
returns a `System`: ``step(global_batch) -> StepResult``, this rank's share of one training step
(forward, backward, AdamW) with its phases timed by ``time.perf_counter`` (no extra
synchronization: the phases are what this rank spent in each call). The adaptations the zoo
GPT needs under DTensor on gloo CPU are written where they are made (`tensor_parallel`).
"""

from __future__ import annotations

import time
import types
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from meshplan.zoo.gpt import GPT, gpt_loss

Batch = tuple[tuple[Tensor], Tensor]   # ((tokens,), target), the zoo's example-batch form


@dataclass
class StepResult:
    """One rank's step: seconds per phase (in order) and its part of the global mean loss as
    ``loss_sum / rows`` summed over ranks (ranks without a loss give 0, 0)."""

    phases: dict[str, float]
    loss_sum: float = 0.0
    rows: float = 0.0


@dataclass
class System:
    """One parallel training setup on this rank: ``step`` runs one training step."""

    name: str
    step: Callable[[Batch], StepResult]
    notes: list[str] = field(default_factory=list)


class Clock:
    """Phase durations by ``lap(name)``: the time since the previous lap."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._last
        self._last = now


def rows_of(batch: Batch, index: int, parts: int) -> Batch:
    """Rows ``index`` of ``parts`` equal contiguous pieces of a global batch."""
    (x,), t = batch
    return (x.chunk(parts)[index],), t.chunk(parts)[index]


def _plain_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Batch,
                loss_ctx: Callable[[], Any] = nullcontext) -> StepResult:
    """forward + loss, backward, optimizer step and zero_grad, each timed."""
    (x,), t = batch
    clock = Clock()
    with loss_ctx():   # loss_parallel's cross-entropy needs its backward inside it too
        loss = gpt_loss(model(x), t)
        clock.lap("forward")
        loss.backward()
        clock.lap("backward")
    opt.step()
    opt.zero_grad()
    clock.lap("optimizer")
    value = loss.detach()
    value = value.full_tensor() if hasattr(value, "full_tensor") else value
    return StepResult(clock.phases, float(value) * len(x), float(len(x)))


def ddp(model: GPT, rank: int, nprocs: int, lr: float) -> System:
    """`DistributedDataParallel` with its default buckets (25 MiB); this rank's rows of the
    batch."""
    from torch.nn.parallel import DistributedDataParallel
    wrapped = DistributedDataParallel(model)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=lr)
    return System("DDP", lambda b: _plain_step(wrapped, opt, rows_of(b, rank, nprocs)))


def fsdp2(model: GPT, rank: int, nprocs: int, lr: float) -> System:
    """FSDP2: `fully_shard` on every transformer block, then on the root (embeddings, final
    norm, tied LM head); default resharding after forward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (nprocs,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    return System("FSDP2", lambda b: _plain_step(model, opt, rows_of(b, rank, nprocs)))


def _local_heads_forward(self: nn.Module, x: Tensor) -> Tensor:
    """`Attention.forward` with the heads this rank holds: q, k, v arrive column-split (whole
    heads), so the merge back is ``(b, s, -1)`` instead of the input's hidden size. The same
    math as the zoo's forward (causal SDPA per head)."""
    b, s, _ = x.shape
    q = self._split_heads(self.q_proj(x))
    k = self._split_heads(self.k_proj(x))
    v = self._split_heads(self.v_proj(x))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
    return self.out_proj(y.transpose(1, 2).reshape(b, s, -1))


def _vocab_parallel_forward(self: GPT, tokens: Tensor) -> Tensor:
    """`GPT.forward` with the tied embedding split over the vocabulary: the LM head's input is
    marked replicated, so the logits come out split over the vocabulary (a DTensor) for
    `loss_parallel`'s cross-entropy."""
    from torch.distributed.tensor import DTensor, Replicate
    seq = tokens.shape[1]
    x = self.wte(tokens) + self.wpe.weight[:seq]
    for block in self.blocks:
        x = block(x)
    h = DTensor.from_local(self.ln_f(x), self.wte.weight.device_mesh, [Replicate()],
                           run_check=False)
    return F.linear(h, self.wte.weight)


def tensor_parallel(model: GPT, rank: int, nprocs: int, lr: float) -> System:
    """Megatron-style tensor parallelism on a (1, P) mesh with `parallelize_module`: q, k, v
    and fc_in `ColwiseParallel`, out_proj and fc_out `RowwiseParallel` in every block; the tied
    embedding / LM head split over the vocabulary (`RowwiseParallel` on ``wte``, the logits
    left split and the loss under `loss_parallel`), as Megatron-LM does. Every rank takes the
    whole batch.

    Adaptations (the zoo GPT as written does not run under DTensor on gloo CPU): DTensor has no
    sharding rule for CPU SDPA (``aten._scaled_dot_product_flash_attention_for_cpu``), so the
    projections return local tensors and each block's attention runs on its local heads:
    ``num_heads`` divided by P and the heads merged with ``reshape(b, s, -1)``
    (`_local_heads_forward`); the tied LM head is a functional ``F.linear`` on ``wte.weight``,
    not a module a parallel style can wrap, so `GPT.forward` marks its input replicated
    (`_vocab_parallel_forward`). No `SequenceParallel` (layer norms replicated)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   loss_parallel, parallelize_module)
    if model.config.num_heads % nprocs:
        raise ValueError(f"tensor parallelism over {nprocs} ranks needs heads divisible by it, "
                         f"got {model.config.num_heads} heads")
    mesh = init_device_mesh("cpu", (nprocs,))
    styles = {"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
              "attn.v_proj": ColwiseParallel(), "attn.out_proj": RowwiseParallel(),
              "mlp.fc_in": ColwiseParallel(), "mlp.fc_out": RowwiseParallel()}
    for block in model.blocks:
        parallelize_module(block, mesh, styles)
        block.attn.num_heads //= nprocs
        block.attn.forward = types.MethodType(_local_heads_forward, block.attn)
    parallelize_module(model, mesh, {"wte": RowwiseParallel(input_layouts=Replicate(),
                                                            output_layouts=Replicate())})
    model.forward = types.MethodType(_vocab_parallel_forward, model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def step(batch: Batch) -> StepResult:
        out = _plain_step(model, opt, batch, loss_parallel)
        # Every rank holds the whole batch's loss: count it once.
        return out if rank == 0 else StepResult(out.phases)

    return System("TP", step, ["Colwise q/k/v/fc_in, Rowwise out_proj/fc_out, vocab-parallel "
                               "wte + LM head + loss_parallel; attention on local heads "
                               "(num_heads / P, reshape(b, s, -1): no DTensor rule for CPU "
                               "SDPA); no SequenceParallel"])


class _FirstStage(nn.Module):
    """Stage 0 of the 2-stage split: embeddings and the first half of the blocks."""

    def __init__(self, model: GPT, cut: int) -> None:
        super().__init__()
        self.wte, self.wpe = model.wte, model.wpe
        self.blocks = nn.ModuleList(model.blocks[:cut])

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.wte(tokens) + self.wpe.weight[:tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return x


class _LastStage(nn.Module):
    """Stage 1: the other blocks, the final norm and the LM head, whose weight is this stage's
    copy of the tied embedding (its gradient summed with stage 0's after backward)."""

    def __init__(self, model: GPT, cut: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(model.blocks[cut:])
        self.ln_f = model.ln_f
        self.head = nn.Parameter(model.wte.weight.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.head)


def replica_rows(batch: Batch, replica: int, replicas: int, microbatches: int) -> Batch:
    """A pipeline replica's rows as meshplan's Megatron plan takes them: the global batch cut
    into ``microbatches`` equal pieces, each piece split over the replicas."""
    (x,), t = batch

    def mine(v: Tensor) -> Tensor:
        return v.reshape(microbatches, replicas, -1, *v.shape[1:])[:, replica].reshape(
            -1, *v.shape[1:])

    return (mine(x),), mine(t)


def pipeline(model: GPT, rank: int, nprocs: int, lr: float, microbatches: int) -> System:
    """Two stages (blocks split in half) with `PipelineStage` and `Schedule1F1B` over
    ``microbatches``; with P > 2 processes, P/2 pipelines, each stage wrapped in DDP over its
    P/2 replicas (a (pp=2, dp=P/2) mesh: stage s on ranks s*P/2 .. s*P/2 + P/2 - 1, meshplan's
    layout). The tied embedding / LM head: each stage holds a copy; after the schedule their
    gradients are all-reduced (summed) between the two stages of a pipeline, as Megatron-LM
    does, so both copies take the same update."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.nn.parallel import DistributedDataParallel
    if nprocs % 2:
        raise ValueError(f"a 2-stage pipeline needs an even process count, got {nprocs}")
    dp = nprocs // 2
    mesh = init_device_mesh("cpu", (2, dp), mesh_dim_names=("pp", "dp"))
    stage_index, replica = divmod(rank, dp)
    cut = len(model.blocks) // 2
    part = _FirstStage(model, cut) if stage_index == 0 else _LastStage(model, cut)
    tied = part.wte.weight if stage_index == 0 else part.head
    module = DistributedDataParallel(part, process_group=mesh.get_group("dp")) if dp > 1 \
        else part
    stage = PipelineStage(module, stage_index, 2, torch.device("cpu"),
                          group=mesh.get_group("pp"))
    schedule = Schedule1F1B(stage, microbatches, loss_fn=gpt_loss)
    opt = torch.optim.AdamW(part.parameters(), lr=lr)
    tied_group = mesh.get_group("pp")

    def step(batch: Batch) -> StepResult:
        (x,), t = replica_rows(batch, replica, dp, microbatches)
        clock = Clock()
        losses: list[Tensor] = []
        if stage_index == 0:
            schedule.step(x)
        else:
            schedule.step(target=t, losses=losses)
        clock.lap("schedule")
        dist.all_reduce(tied.grad, group=tied_group)
        clock.lap("sync")
        opt.step()
        opt.zero_grad()
        clock.lap("optimizer")
        rows = len(x) / microbatches
        return StepResult(clock.phases, sum(float(v) for v in losses) * rows,
                          rows * len(losses))

    layout = f"pp=2 x dp={dp}" + (" (each stage DDP over its replicas)" if dp > 1 else "")
    return System("pipelining", step, [f"{layout}, manual PipelineStage split (blocks "
                                       f"[0, {cut}) | [{cut}, {len(model.blocks)})), "
                                       f"Schedule1F1B, {microbatches} micro-batches; tied "
                                       "wte / LM head: a copy per stage, gradients all-reduced "
                                       "between the stages"])
