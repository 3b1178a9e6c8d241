"""Pipeline stage programs (`lower/program.py` on `stage_graphs`): each stage's local program
takes what earlier stages send and returns what later ones receive; chained forward and
backward by hand on one-device stages, they give single-device training's loss and gradients."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

import meshplan.api as api
from meshplan.capture.batch import split_microbatches
from meshplan.capture.to_ir import capture
from meshplan.lower.pipeline_program import pipeline_program, stage_graphs
from meshplan.runtime.emulated import EmulatedComm, _World
from meshplan.runtime.trainer import Trainer
from meshplan.zoo.spec import build_workload

CASES = [("mlp:hidden=16,layers=4,batch=8", 2), ("mlp:hidden=16,layers=6,batch=8", 3),
         ("gpt:hidden=32,layers=3,heads=4,seq=8,vocab=64,batch=4", 3)]


@pytest.mark.parametrize("spec,stages", CASES)
def test_chained_stage_programs_equal_one_device(spec: str, stages: int) -> None:
    meta = build_workload(spec, device="meta")
    plan = api.plan(meta.model, meta.loss_fn, "sgd", meta.example_batch, f"local:{stages}",
                    method=f"megatron:dp=1,tp=1,pp={stages}", dtype="fp32", memory_budget_gb=0,
                    microbatches=1)
    assert plan.num_stages == stages
    w = build_workload(spec, device="cpu", seed=0)
    batch = split_microbatches(w.example_batch, 1)[0]
    traced, graph = capture(w.model, w.loss_fn, batch)
    graphs = stage_graphs(graph, plan)
    program = pipeline_program(plan)
    trainers = [Trainer(s.plan, w.model, w.loss_fn, w.example_batch,
                        EmulatedComm(0, (1, 1), _World((1, 1), 30.0)), captured=(traced, g))
                for s, g in zip(plan.stages, graphs)]
    # Forward, stage by stage: what a stage sends is what later stages receive.
    rng = torch.Generator().manual_seed(0)
    sent: dict[str, torch.Tensor] = {}
    received: list[dict[str, torch.Tensor]] = []
    loss = None
    for i, t in enumerate(trainers):
        inbox = {e.value: sent[e.value].detach().requires_grad_(True)
                 for e in program.exchanges if e.dst == i}
        received.append(inbox)
        out, values = t.program.split_output(
            t._run(t._program_args(t.local_batch(batch), inbox), rng))
        assert set(t.program.sent) == {e.value for e in program.exchanges if e.src == i}
        assert (out is None) == (i < stages - 1)
        sent.update(zip(t.program.sent, values))
        loss = out if out is not None else loss
    # Backward, last stage first: a stage's outputs get the gradients of their receivers.
    loss.backward()
    for i in range(stages - 2, -1, -1):
        outs = [sent[v] for v in trainers[i].program.sent]
        grads = [sum(r[v].grad for r in received if v in r) for v in trainers[i].program.sent]
        torch.autograd.backward(outs, grads)
    ref_model = build_workload(spec, device="cpu", seed=0)
    inputs, target = batch
    ref_loss = ref_model.loss_fn(ref_model.model(*inputs) if isinstance(inputs, tuple)
                                 else ref_model.model(inputs), target)
    ref_loss.backward()
    assert float(loss.detach()) == pytest.approx(float(ref_loss.detach()), rel=1e-6)
    grads = defaultdict(lambda: 0)
    for t in trainers:   # a tied parameter (GPT's embedding and head) gets one part per stage
        for p in t.params:
            grads[p.name] = grads[p.name] + p.compute.grad
    for name, param in ref_model.model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-6)
