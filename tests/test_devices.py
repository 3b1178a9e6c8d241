"""Where ranks compute (`runtime/devices.py`): the device chosen from the environment or named,
the backend that follows it, Ray's GPU requests, and — the part a CPU machine can check — that
every plan family keeps all of a rank's tensors on the rank's device.

A CPU build has no second device to mix the CPU with, so the placement tests run whole training
steps on the *meta* device (shapes, no data) under a dispatch mode that rejects any op whose
tensors live on two devices (a 0-dim CPU tensor excepted, as CUDA allows it): a constant, mask,
batch piece, received activation, gradient bucket or optimizer state made on the CPU by mistake
meets a meta tensor in some op and fails the test, as it would fail on a GPU.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import meshplan
from meshplan.capture.batch import split_microbatches
from meshplan.capture.to_ir import capture
from meshplan.runtime import devices
from meshplan.runtime.emulated import run_emulated, run_emulated_stages
from meshplan.runtime.pipeline import PipelineTrainer
from meshplan.runtime.run_script import ray_placement
from meshplan.runtime.trainer import Trainer
from meshplan.runtime.optim import OptimizerSpec
from meshplan.zoo.spec import Workload, build_workload
from hetero_cases import RATIOS, four_speeds
from oracle import batches

MLP = "mlp:layers=3,hidden=16,batch=8,bias=1"
BERT = "bert:hidden=32,layers=2,heads=4,seq=16,vocab=64,batch=8"
GPT = "gpt:hidden=32,layers=4,heads=4,seq=8,vocab=64,batch=8"
MOE = "moe:hidden=16,layers=2,heads=2,experts=4,seq=8,vocab=32,batch=4"
META = torch.device("meta")


def test_the_device_comes_from_the_environment_unless_named(monkeypatch) -> None:
    monkeypatch.delenv(devices.DEVICE_ENV, raising=False)
    assert devices.resolve_device() == torch.device("cpu")          # no CUDA here
    assert devices.resolve_device("auto") == torch.device("cpu")
    assert devices.resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setenv(devices.DEVICE_ENV, "meta")                  # a launcher's --device
    assert devices.resolve_device() == META
    assert devices.resolve_device("cpu") == torch.device("cpu")     # named wins
    with pytest.raises(RuntimeError, match="no CUDA device.*device='cpu'"):
        devices.resolve_device("cuda")
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        devices.resolve_device("xla")
    with pytest.raises(ValueError, match="one of"):
        devices.resolve_device("gpu")


def test_the_backend_follows_the_device() -> None:
    assert devices.backend_for(torch.device("cuda", 3)) == "cpu:gloo,cuda:nccl"
    assert devices.backend_for(torch.device("cpu")) == "gloo"


def test_ray_actors_ask_for_a_gpu_each_when_the_ranks_run_on_gpus() -> None:
    assert ray_placement(None, 8.0, 8) == (1, "cuda")      # a GPU for every rank: used
    assert ray_placement("auto", 4.0, 8) == (0, "cpu")     # too few: the CPU
    assert ray_placement("cpu", 8.0, 8) == (0, "cpu")
    assert ray_placement("cuda", 8.0, 4) == (1, "cuda")
    with pytest.raises(ValueError, match="GPU per rank: 8 ranks, the cluster has 4"):
        ray_placement("cuda", 4.0, 8)
    with pytest.raises(ValueError, match="one of"):
        ray_placement("tpu", 8.0, 8)


def test_launchers_refuse_an_unknown_device() -> None:
    from meshplan.runtime.pool import WorkerPool
    with pytest.raises(ValueError, match="device must be one of"):
        WorkerPool(2, device="gpu")


# ---------------------------------------------------------------- placement, on meta tensors
class OneDevice(TorchDispatchMode):
    """Raises on any op whose tensors span two devices (0-dim CPU tensors aside)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat, _ = tree_flatten((args, kwargs or {}))
        where = {t.device for t in flat if isinstance(t, torch.Tensor)
                 and not (t.device.type == "cpu" and t.dim() == 0)}
        if len(where) > 1:
            raise RuntimeError(f"{func} mixes tensors on {sorted(map(str, where))}")
        return func(*args, **(kwargs or {}))


def _on_meta(monkeypatch) -> None:
    # A meta tensor has no value: the step's loss is not read back (the one host read of a
    # step), everything before it runs.
    monkeypatch.setattr(Trainer, "_report", lambda self, loss: 0.0)
    monkeypatch.setattr(PipelineTrainer, "_report", lambda self, total, count: 0.0)


def _workload(spec: str) -> Workload:
    if spec != "dropout":
        return build_workload(spec, device="cpu", seed=0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(32, 16))
    return Workload(model, torch.nn.functional.mse_loss,
                    ((torch.randn(8, 16),), torch.randn(8, 16)), "dropout")


def _plan(spec: str, cluster: Any, opt: Any = "adamw", **kw: Any) -> meshplan.Plan:
    w = _workload(spec)
    return meshplan.plan(w.model, w.loss_fn, opt, w.example_batch, cluster,
                         memory_budget_gb=0, name=spec, **kw)


def _steps(comm, plan: meshplan.Plan, w, data, captured, p2p=None) -> list[str]:
    """Two steps of the user's loop (AdamW, clipping when planned) under `OneDevice`; returns
    the devices of everything the rank keeps."""
    with OneDevice():
        model = copy.deepcopy(w.model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = meshplan.parallelize(model, opt, plan, w.loss_fn, comm=comm, p2p=p2p,
                                          captured=captured)
        for batch in data:
            loss = model(batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
    kept = [t for g in opt.param_groups for t in g["params"]]
    kept += [v for s in opt.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    engine = model._pipeline or model._trainer
    trainers = engine.trainers.values() if model._pipeline else [engine]
    for t in trainers:
        kept += list(t.buffers.values()) + [p.compute for p in t.params if p.compute is not None]
    return sorted({str(t.device) for t in kept})


def _pipeline_steps(comm, p2p, plan, w, data, captured) -> list[str]:
    return _steps(comm, plan, w, data, captured, p2p)


CASES = {
    "data": (MLP, "local:4", dict(mesh_shape=(1, 4), method="data")),
    "zero2-clip": (MLP, "local:4", dict(mesh_shape=(2, 2), method="zero2",
                                        opt=OptimizerSpec("adamw", max_grad_norm=1e-3))),
    "zero3": (BERT, "local:4", dict(mesh_shape=(2, 2), method="zero3", microbatches=2)),
    "megatron-bf16": (BERT, "local:2", dict(mesh_shape=(1, 2), method="megatron",
                                            dtype="bf16")),
    "auto-recompute": (GPT, "local:4", dict(mesh_shape=(2, 2), method="intra-only",
                                            recompute="full")),
    "dropout": ("dropout", "local:4", dict(mesh_shape=(2, 2), method="intra-only")),
    "moe-expert": (MOE, "local:4", dict(mesh_shape=(1, 4), method="expert")),
    "hetero-sfb": (MLP, four_speeds(), dict(method="hetero", axis_weights=RATIOS,
                                            sfb="force")),
    "segments": (BERT, four_speeds(), dict(method="hetero", segment_ratios=[
        [0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]])),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_tensor_of_a_step_lives_on_the_ranks_device(case: str, monkeypatch) -> None:
    _on_meta(monkeypatch)
    spec, cluster, kw = CASES[case]
    plan = _plan(spec, cluster, **kw)
    w = _workload(spec)
    captured = capture(w.model, w.loss_fn, split_microbatches(w.example_batch,
                                                              plan.microbatches)[0])
    for kept in run_emulated(_steps, plan.mesh_shape, plan, w, batches(w, 2), captured,
                             device=META):
        assert kept == ["meta"]


@pytest.mark.parametrize("method", ["megatron:dp=1,tp=2,pp=2", "megatron:dp=1,tp=1,pp=2,virtual=2"])
def test_a_pipelines_tensors_and_messages_live_on_the_ranks_device(method: str,
                                                                    monkeypatch) -> None:
    _on_meta(monkeypatch)
    plan = _plan(GPT, f"local:{4 if 'tp=2' in method else 2}", method=method, microbatches=4)
    w = _workload(GPT)
    captured = capture(w.model, w.loss_fn, split_microbatches(w.example_batch,
                                                              plan.microbatches)[0])
    for kept in run_emulated_stages(_pipeline_steps, plan.stage_meshes(), plan, w,
                                    batches(w, 2), captured, device=META):
        assert kept == ["meta"]


def test_the_dispatch_check_catches_a_tensor_left_on_the_cpu() -> None:
    """The check itself: a CPU index into a meta table (which meta kernels accept, and CUDA
    does not) is caught."""
    table = torch.empty(4, 3, device=META)
    with pytest.raises(RuntimeError, match="mixes tensors"):
        with OneDevice():
            torch.nn.functional.embedding(torch.tensor([1, 2]), table)
