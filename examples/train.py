"""Train a zoo model under a saved plan with the loop PyTorch users write.

    meshplan plan gpt:hidden=64,layers=4,heads=4,seq=16,vocab=128,batch=8 \
        --cluster local:2 --method megatron:dp=1,tp=1,pp=2 -o plan.json
    meshplan run --nproc 2 examples/train.py plan.json             # 2 local processes
    meshplan run --ray --nproc 2 examples/train.py plan.json       # 2 actors on a local Ray
    torchrun --nnodes 2 --node-rank R --nproc-per-node 1 --rdzv-backend c10d \
        --rdzv-endpoint HOST:29500 examples/train.py plan.json     # one per machine

Every rank builds the same model (seed 0) and the same global batches (seed 1 + step);
``meshplan.parallelize`` joins the world the launcher describes, gives each rank its part of
the model and points the optimizer at its shards. With ``--checkpoint DIR`` the run saves
after every step (``DIR/step-K``, then ``DIR/latest``) and, started again, resumes from the
latest one — under this plan or another. Rank 0 prints each step's loss and writes the
losses of the steps it ran, by step, as JSON to ``--losses``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

import meshplan
from meshplan.progress import progress
from meshplan.zoo.spec import build_workload


def train(plan_path: str, steps: int, losses_path: str | None, checkpoint: str | None) -> None:
    plan = meshplan.load_plan(plan_path)
    w = build_workload(plan.model, device="cpu", seed=0)   # the plan's model, the same state
    optimizer = torch.optim.AdamW(w.model.parameters(), lr=1e-3)
    model, optimizer = meshplan.parallelize(w.model, optimizer, plan, w.loss_fn)
    first = 0
    latest = os.path.join(checkpoint, "latest") if checkpoint else None
    if latest and os.path.isfile(latest):
        with open(latest) as f:
            first = int(f.read())
        meshplan.load_checkpoint(os.path.join(checkpoint, f"step-{first}"), model, optimizer)
    losses = {}
    for step in progress(range(first, steps), total=steps - first, desc="training",
                         unit="step", enabled=dist.get_rank() == 0):
        batch = build_workload(plan.model, device="cpu", seed=1 + step).example_batch
        loss = model(batch)            # this rank's part of the step; the whole batch's loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = loss.item()
        if dist.get_rank() == 0:
            print(f"step {step} loss {losses[step]:.6f}", flush=True)
        if checkpoint:
            meshplan.save_checkpoint(os.path.join(checkpoint, f"step-{step + 1}"), model,
                                     optimizer)
            if dist.get_rank() == 0:   # written once the checkpoint is whole
                with open(latest + ".tmp", "w") as f:
                    f.write(str(step + 1))
                os.replace(latest + ".tmp", latest)
    if dist.get_rank() == 0 and losses_path:
        with open(losses_path, "w") as f:
            json.dump(losses, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan", help="a plan saved with 'meshplan plan ... -o plan.json'")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--losses", metavar="JSON", help="rank 0 writes the losses here")
    ap.add_argument("--checkpoint", metavar="DIR", help="save every step; resume if present")
    args = ap.parse_args()
    try:
        train(args.plan, args.steps, args.losses, args.checkpoint)
    except ValueError as err:   # a plan for another world or model: one line, not a trace
        sys.exit(f"train.py: error: {err}")


if __name__ == "__main__":
    main()
