"""Train a zoo model under a saved plan with the loop PyTorch users write.

    meshplan plan gpt:hidden=64,layers=4,heads=4,seq=16,vocab=128,batch=8 \
        --cluster local:2 --method megatron:dp=1,tp=1,pp=2 -o plan.json
    meshplan run --nproc 2 examples/train.py plan.json            # 2 local processes
    torchrun --nnodes 2 --node-rank R --nproc-per-node 1 --rdzv-backend c10d \
        --rdzv-endpoint HOST:29500 examples/train.py plan.json    # one per machine

Every rank builds the same model (seed 0) and the same global batches (seeds 1, 2, ...);
``meshplan.parallelize`` joins the world the launcher describes, gives each rank its part of
the model and points the optimizer at its shards. Rank 0 prints the losses, and writes them
as JSON to the second argument when one is given.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

import meshplan
from meshplan.progress import progress
from meshplan.zoo.spec import build_workload


def main(plan_path: str, out: str | None = None, steps: int = 3) -> None:
    plan = meshplan.load_plan(plan_path)
    w = build_workload(plan.model, device="cpu", seed=0)   # the plan's model, the same state
    optimizer = torch.optim.AdamW(w.model.parameters(), lr=1e-3)
    model, optimizer = meshplan.parallelize(w.model, optimizer, plan, w.loss_fn)
    losses = []
    for step in progress(range(steps), total=steps, desc="training", unit="step",
                         enabled=dist.get_rank() == 0):
        batch = build_workload(plan.model, device="cpu", seed=1 + step).example_batch
        loss = model(batch)            # this rank's part of the step; the whole batch's loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if dist.get_rank() == 0:
        print("losses", losses)
        if out:
            with open(out, "w") as f:
                json.dump(losses, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
