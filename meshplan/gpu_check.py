"""``make gpu-check`` (``python -m meshplan.gpu_check``): meshplan on one real GPU, in one run.

What a GPU machine lent for a few minutes can show, and a CPU machine cannot (DESIGN.md §8):

(a) **Equivalence.** Four emulated ranks sharing the one GPU run every plan family — data,
    Megatron, ZeRO-3 with micro-batches, a 2-stage pipeline and an uneven (HAP) plan — three
    SGD steps each, against one device doing the same steps: in fp32 with TF32 off within
    1e-5 of each tensor's size; in bf16 within the bounds of `tests/test_training_step.py`
    (losses 4u, parameters 32u of the update's norm, u = 2^-8).
(b) **Prediction.** A single-GPU bf16 GPT (1.3B, or the largest preset that fits) trained
    with a one-device plan: the measured step time and ``torch.cuda.max_memory_allocated``
    against ``simulate`` of the same plan on the GPU's preset (goals: ±15 % time, ±10 %
    memory), and beside the same model in a plain PyTorch loop, with one step profiled (its
    kernels' time by kind against its wall time: launch-bound or slow kernels). The GPU is
    then measured (`cost/calibrate.device_figures`: matmul TFLOP/s per dtype, HBM
    bandwidth) and the plan simulated again on those figures.
(c) **Launch.** ``meshplan run --nproc 1 examples/train.py`` end to end on the GPU's world
    (NCCL beside gloo): two steps saved in a DCP checkpoint, resumed for two more, the four
    losses those of the same loop on one device without meshplan.

It prints what it ran, skipped and why, and writes the same as markdown (``--out``, by default
``docs/gpu.md`` on a GPU). ``--device cpu`` runs the same script on the CPU with the same
checks, (b)'s goals aside (the CPU preset is not this machine): a test of ``make test``, so
the script cannot rot where no GPU is. Exit status 1 if a check failed.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Iterator

import torch

ROUNDOFF = {"bf16": 2.0 ** -8}
# (a)'s collectives take milliseconds: one that waits a minute is a hang, reported as such.
COLLECTIVE_TIMEOUT_S = 60
STEPS = 3
LR = 0.1
MLP = "mlp:layers=3,hidden=16,batch=8,bias=1"
GPT = "gpt:hidden=32,layers=4,heads=4,seq=8,vocab=64,batch=8"
# (b)'s GPTs: the first is the one the H200's figures were set on (docs/calibration.md), the
# others are predictions made with them (another width, another sequence length); each that
# fits the GPU's memory is measured.
GPU_GPTS = ("gpt:preset=1.3b,seq=1024,batch=8", "gpt:preset=350m,seq=2048,batch=8",
            "gpt:preset=2.6b,seq=1024,batch=8")
CPU_GPT = "gpt:hidden=128,layers=2,heads=4,seq=64,vocab=512,batch=8"


@dataclass(frozen=True)
class Check:
    """One line of the report: ``status`` is "pass", "fail", "skip" or "info"."""

    part: str
    name: str
    status: str
    detail: str


# ---------------------------------------------------------------- (a) equivalence
def _four_speeds() -> Any:
    from meshplan.cost.cluster import mixed_cluster
    from meshplan.cost.devices import DeviceType, Link

    def dev(name: str, flops: float) -> DeviceType:
        return DeviceType(name, {"float32": flops, "bfloat16": flops}, 16 * 2**30, flops, 1.0,
                          1.0)

    link = Link(1e9, 1e-7)
    return mixed_cluster("four-speeds", [[dev("fast", 4e9), dev("mid", 3e9)],
                                         [dev("slow", 2e9), dev("slowest", 1e9)]], link, link)


CASES: dict[str, tuple[str, Any, dict[str, Any]]] = {
    "data (1, 4)": (MLP, "local:4", dict(mesh_shape=(1, 4), method="data")),
    "megatron (1, 4)": (GPT, "local:4", dict(mesh_shape=(1, 4), method="megatron")),
    "zero3 (2, 2), 2 micro-batches": (GPT, "local:4", dict(mesh_shape=(2, 2), method="zero3",
                                                          microbatches=2)),
    "pipeline: 2 stages of tp=2, 1F1B, 4 micro-batches": (
        GPT, "local:4", dict(method="megatron:dp=1,tp=2,pp=2", microbatches=4)),
    "hetero: shares 0.4/0.3/0.2/0.1": (MLP, "four-speeds", dict(
        method="hetero", axis_weights=((1.0,), (0.4, 0.3, 0.2, 0.1)))),
}


def _reference(w: Any, data: list, dtype: str, microbatches: int, device: torch.device
               ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One device, the same steps: SGD, micro-batches accumulated (1/B each), autocast."""
    from meshplan.capture.batch import flatten_batch, split_microbatches, step_loss
    from meshplan.runtime.step_modes import autocast_for
    model = copy.deepcopy(w.model).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for batch in data:
        total = 0.0
        for piece in split_microbatches(batch, microbatches):
            layout, tensors = flatten_batch(piece)
            args, kwargs, target = layout.call([t.to(device) for t in tensors.values()])
            with autocast_for(dtype, device.type):
                loss = step_loss(w.loss_fn, model(*args, **kwargs), target)
            (loss / microbatches).backward()
            total += loss.item() / microbatches
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {k: v.detach().cpu() for k, v in model.named_parameters()}


def _rank(comm: Any, plan: Any, w: Any, data: list, captured: Any, p2p: Any = None) -> tuple:
    from meshplan.runtime.pipeline import PipelineTrainer
    from meshplan.runtime.trainer import Trainer
    tr = PipelineTrainer(plan, w.model, w.loss_fn, w.example_batch, comm, p2p,
                         captured=captured) if p2p is not None else \
        Trainer(plan, w.model, w.loss_fn, w.example_batch, comm, captured=captured)
    losses = [tr.step(b, seed=i) for i, b in enumerate(data)]
    return losses, {k: v.cpu() for k, v in tr.full_state_dict().items()}


def _stage_rank(comm: Any, p2p: Any, plan: Any, w: Any, data: list, captured: Any) -> tuple:
    return _rank(comm, plan, w, data, captured, p2p)


def _compare(dtype: str, got: tuple, ref: tuple, init: dict[str, torch.Tensor]) -> str | None:
    """None if ``got`` equals ``ref`` within the dtype's bound, else what differs."""
    losses, params = got
    ref_losses, ref_params = ref
    if dtype == "fp32":
        loss_err = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
        if loss_err > 1e-5:
            return f"loss differs by {loss_err:.2e} (relative) > 1e-5"
        floor = 1e-3 * max(r.abs().max().item() for r in ref_params.values() if r.numel())
        for name, r in ref_params.items():
            err = (params[name] - r).abs().max().item() if r.numel() else 0.0
            if err > 1e-5 * max(r.abs().max().item() if r.numel() else 0.0, floor):
                return f"{name} differs by {err:.2e} > 1e-5 of its size"
        return None
    u = ROUNDOFF[dtype]
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    if loss_err > 4 * u:
        return f"loss differs by {loss_err:.2e} > 4u = {4 * u:.2e}"

    def norm(d: dict) -> float:
        return math.sqrt(sum(v.double().pow(2).sum().item() for v in d.values()))

    update = norm({k: ref_params[k] - init[k] for k in ref_params})
    diff = norm({k: params[k] - ref_params[k] for k in ref_params})
    if diff > 32 * u * update:
        return f"parameters differ by {diff:.2e} > 32u of the update ({32 * u * update:.2e})"
    return None


def check_equivalence(device: torch.device) -> Iterator[Check]:
    """(a): every case in fp32 and bf16 on four emulated ranks of ``device``, each yielded as
    it ends (a lent GPU's minutes are few: what ran is printed before what hangs)."""
    for name, (spec, cluster, kw) in CASES.items():
        for dtype in ("fp32", "bf16"):
            try:
                yield _equivalence_case(device, name, spec, cluster, kw, dtype)
            except Exception as e:   # reported; the other cases still run
                yield Check("a", f"{name}, {dtype}", "fail", f"{type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}")


def _equivalence_case(device: torch.device, name: str, spec: str, cluster: Any,
                      kw: dict[str, Any], dtype: str) -> Check:
    import meshplan
    from meshplan.capture.batch import split_microbatches
    from meshplan.capture.to_ir import capture
    from meshplan.runtime.emulated import run_emulated, run_emulated_stages
    from meshplan.runtime.optim import OptimizerSpec
    from meshplan.zoo.spec import build_workload
    started = time.perf_counter()
    w = build_workload(spec, device="cpu", seed=0)
    cl = _four_speeds() if cluster == "four-speeds" else cluster
    plan = meshplan.plan(w.model, w.loss_fn, OptimizerSpec("sgd", lr=LR), w.example_batch, cl,
                         memory_budget_gb=0, dtype=dtype, name=spec, **kw)
    g = torch.Generator().manual_seed(5)
    (x,), t = w.example_batch
    data = [((torch.randint(0, int(x.max()) + 1, x.shape, generator=g)
              if not x.is_floating_point() else torch.randn(x.shape, generator=g),),
             torch.randint(0, int(t.max()) + 1, t.shape, generator=g)
             if not t.is_floating_point() else torch.randn(t.shape, generator=g))
            for _ in range(STEPS)]
    micro = split_microbatches(w.example_batch, plan.microbatches)[0]
    captured = capture(w.model, w.loss_fn, micro)
    if plan.num_stages > 1:
        results = run_emulated_stages(_stage_rank, plan.stage_meshes(), plan, w, data,
                                      captured, device=device, timeout_s=COLLECTIVE_TIMEOUT_S)
        params: dict = {}
        for _, state in results:
            params.update(state)
        got = (results[0][0], params)
    else:
        results = run_emulated(_rank, plan.mesh_shape, plan, w, data, captured,
                               device=device, timeout_s=COLLECTIVE_TIMEOUT_S)
        got = results[0]
    ref = _reference(w, data, dtype, plan.microbatches, device)
    init = {k: v.detach().cpu() for k, v in w.model.named_parameters()}
    wrong = _compare(dtype, got, ref, init)
    took = time.perf_counter() - started
    return Check("a", f"{name}, {dtype}", "fail" if wrong else "pass",
                 (wrong or f"losses {', '.join(f'{v:.6f}' for v in got[0])}")
                 + f" ({took:.1f} s)")


# ---------------------------------------------------------------- (b) prediction
def _cluster_for(device: torch.device) -> Any:
    """One device of the GPU's preset (by its name), or the CPU preset."""
    from meshplan.cost.cluster import parse_cluster_spec
    from meshplan.cost.devices import device_type
    one = parse_cluster_spec("dgx-h100:1x1")
    if device.type != "cuda":
        return parse_cluster_spec("local:1")
    name = torch.cuda.get_device_name(device)
    for preset in ("H200", "H100-SXM", "A100-SXM4-80GB", "A100-SXM4-40GB", "V100-SXM2-32GB"):
        if preset.split("-")[0] in name:
            return replace(one, name=f"one {preset}", device=device_type(preset))
    raise ValueError(f"no device preset for {name!r}")


def _timed_steps(step: Callable[[int], Any], device: torch.device, steps: int
                 ) -> tuple[float, int]:
    """Median seconds of ``step(i)`` after two warm-up steps (kernels chosen, optimizer state
    made), and the peak bytes allocated while timed (0 on the CPU)."""
    cuda = device.type == "cuda"
    for i in range(2):
        step(i)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        step(i)
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), (torch.cuda.max_memory_allocated(device) if cuda else 0)


# Where a step's device time goes, by the names of its kernels (GPU) or ops (CPU).
KINDS = (("matmul", ("gemm", "nvjet", "cutlass", "xmma", "aten::mm", "aten::addmm",
                     "aten::bmm", "aten::baddbmm")),
         ("attention", ("flash", "fmha", "sdpa", "attention", "softmax")),
         ("optimizer", ("adam", "multi_tensor", "foreach")),
         ("copy", ("copy",)))
# The trace categories of work on the device (kernels, copies, memsets); the rest is the host's
# (ops, runtime calls, the profiler's own "overhead" such as a full command buffer).
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")

# Where ``profile_step`` writes each profiled step's op table and trace (``--profile-dir``).
PROFILE_DIR: str | None = None


def profile_step(step: Callable[[], Any], device: torch.device, name: str = "step") -> str:
    """One ``step()`` under torch.profiler: its wall time, the time the device was busy (its
    kernels, on a GPU) or its ops ran (on the CPU), by kind, and the costliest three of the
    rest. Says whether a step is launch-bound (the device idle for much of the wall, the host
    still launching when the last kernel could have ended) or slow in its kernels. With
    ``PROFILE_DIR`` set, the whole op table and a Chrome trace are written there as
    ``name``.*."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        step()
        host = time.perf_counter() - t0   # until the host returned: its launches all issued
        if cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace)   # once: the profiler refuses a second export
        if PROFILE_DIR:
            _dump_profile(prof, trace, os.path.join(PROFILE_DIR, name), cuda)
        spans = _device_spans(trace) if cuda else []
    if cuda:
        work = [(n, d) for n, _, d in spans]
        busy = _union_ms(spans)
    else:
        work = [(e.key, e.self_cpu_time_total / 1e3) for e in prof.key_averages()
                if e.key.startswith("aten::") and e.self_cpu_time_total > 0]
        busy = sum(d for _, d in work)
    by_kind: dict[str, float] = {}
    rest: dict[str, float] = {}
    for key, ms in work:
        kind = next((k for k, marks in KINDS if any(m in key.lower() for m in marks)), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + ms
        if kind == "other":
            rest[key] = rest.get(key, 0.0) + ms
    top = sorted(rest.items(), key=lambda kv: -kv[1])[:3]
    return (f"one step profiled: {'device busy' if cuda else 'ops'} {busy:.1f} ms of "
            f"{wall * 1e3:.1f} ms wall ({busy / (wall * 1e3):.0%})"
            + (f", {len(work)} kernels, host done after {host * 1e3:.1f} ms" if cuda else "")
            + ": "
            + ", ".join(f"{k} {v:.1f}" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]))
            + "; costliest other: " + ", ".join(f"{k[:60]} {v:.1f}" for k, v in top))


def _device_spans(trace: str) -> list[tuple[str, float, float]]:
    """(name, start ms, duration ms) of the device's work in the Chrome trace at ``trace``
    (`DEVICE_CATEGORIES`)."""
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    return [(e["name"], e["ts"] / 1e3, e["dur"] / 1e3) for e in events
            if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES]


def _union_ms(spans: list[tuple[str, float, float]]) -> float:
    """Milliseconds covered by at least one of ``spans`` (overlapping kernels once)."""
    total, end = 0.0, -math.inf
    for _, start, dur in sorted(spans, key=lambda s: s[1]):
        total += max(0.0, start + dur - max(start, end))
        end = max(end, start + dur)
    return total


def _dump_profile(prof: Any, trace: str, stem: str, cuda: bool) -> None:
    """``prof``'s op table (by self device time on a GPU) to ``stem``.txt and its Chrome trace
    (exported at ``trace``) to ``stem``.json.gz."""
    import gzip
    import shutil
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    with open(stem + ".txt", "w") as f:
        f.write(prof.key_averages().table(sort_by=key, row_limit=120, max_name_column_width=90))
    with open(trace, "rb") as src, gzip.open(stem + ".json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)


def _eager_step_s(spec: str, device: torch.device, steps: int) -> tuple[float, str]:
    """The same model in a plain PyTorch loop on ``device`` (autocast bf16, AdamW): what
    meshplan's one-device step is measured against, as the simulator is."""
    from meshplan.capture.batch import flatten_batch, step_loss
    from meshplan.runtime.step_modes import autocast_for
    from meshplan.zoo.spec import build_workload
    w = build_workload(spec, device="cpu", seed=0)
    model = w.model.to(device)
    opt = torch.optim.AdamW(model.parameters())
    layout, tensors = flatten_batch(w.example_batch)
    args, kwargs, target = layout.call([t.to(device) for t in tensors.values()])

    def step(_: int) -> None:
        with autocast_for("bf16", device.type):
            loss = step_loss(w.loss_fn, model(*args, **kwargs), target)
        loss.backward()
        opt.step()
        opt.zero_grad()

    step_s = _timed_steps(step, device, steps)[0]
    return step_s, profile_step(lambda: step(steps), device, "plain")


def _measure(plan: Any, spec: str, device: torch.device, steps: int, profiled: bool = True
             ) -> tuple[float, int, str]:
    """Median step seconds, peak bytes allocated and (``profiled``) a one-step profile of
    ``plan`` trained on ``device``."""
    from meshplan.runtime.emulated import run_emulated
    from meshplan.runtime.trainer import Trainer
    from meshplan.zoo.spec import build_workload

    def one(comm: Any) -> tuple[float, int, str]:
        # Built on the CPU (the zoo builds on "cpu" or "meta"): the trainer copies its shards
        # to the rank's device, so the GPU holds only what training does.
        w = build_workload(spec, device="cpu", seed=0)
        tr = Trainer(plan, w.model, w.loss_fn, w.example_batch, comm)
        batch = w.example_batch
        del w   # the trainer holds its own copy of the state
        step_s, peak = _timed_steps(lambda i: tr.step(batch, seed=i), device, steps)
        return step_s, peak, profile_step(lambda: tr.step(batch, seed=steps), device,
                                          "meshplan") if profiled else ""

    return run_emulated(one, (1, 1), device=device, timeout_s=600)[0]


def check_prediction(device: torch.device) -> Iterator[Check]:
    """(b): one device's bf16 GPTs, measured against the simulator; the first also beside a
    plain PyTorch loop and profiled, and the GPU's own figures measured."""
    from meshplan.sim.simulate import simulate
    cluster = _cluster_for(device)
    cuda = device.type == "cuda"
    first = None
    for spec in (GPU_GPTS if cuda else (CPU_GPT,)):
        plan = _one_device_plan(spec, cluster)
        sim = simulate(plan)
        try:
            step_s, peak, profiled = _measure(plan, spec, device, 5 if cuda else 2,
                                              profiled=first is None)
        except torch.cuda.OutOfMemoryError:
            yield Check("b", spec, "skip", "does not fit this GPU's memory")
            torch.cuda.empty_cache()
            continue
        if cuda:
            torch.cuda.empty_cache()
        t_ratio = step_s / sim.step_time_s
        line = (f"measured {step_s * 1e3:.1f} ms/step, simulated {sim.step_time_s * 1e3:.1f} "
                f"on {cluster.device.name} (x{t_ratio:.2f})")
        if not cuda:
            yield Check("b", spec, "info", line + "; the CPU preset is not this machine, so "
                        "no goal applies")
        else:
            m_ratio = peak / sim.peak_memory_bytes[0]
            line += (f"; peak memory measured {peak / 2**30:.2f} GiB, simulated "
                     f"{sim.peak_memory_bytes[0] / 2**30:.2f} GiB (x{m_ratio:.2f})")
            ok = abs(t_ratio - 1) <= 0.15 and abs(m_ratio - 1) <= 0.10
            yield Check("b", spec, "pass" if ok else "fail", line)
        if first is None:
            first = spec, step_s
            eager_s, eager_profiled = _eager_step_s(spec, device, 5 if cuda else 2)
            yield Check("b", "plain PyTorch", "info",
                        f"the same model in a plain loop (autocast bf16, AdamW): "
                        f"{eager_s * 1e3:.1f} ms/step; meshplan's step x{step_s / eager_s:.2f} "
                        "of it")
            yield Check("b", "profile", "info", profiled)
            yield Check("b", "plain profile", "info", eager_profiled)
    if first is not None:
        # Always: the GPU's own figures are what docs/calibration.md and the presets are
        # checked against, and they cost seconds.
        yield _recalibrated(first[0], cluster, device, first[1])


def _one_device_plan(spec: str, cluster: Any) -> Any:
    """``spec`` planned bf16 with AdamW on one device of ``cluster`` (built on meta)."""
    import meshplan
    from meshplan.zoo.spec import build_workload
    w = build_workload(spec, device="meta")
    return meshplan.plan(w.model, w.loss_fn, "adamw", w.example_batch, cluster,
                         mesh_shape=(1, 1), method="data", dtype="bf16", name=spec,
                         memory_budget_gb=0)


def _recalibrated(spec: str, cluster: Any, device: torch.device, step_s: float) -> Check:
    """The GPU measured, and ``spec`` planned and simulated again on those figures (a plan's
    compute times are priced when it is made, so the plan is made again)."""
    from meshplan.cost.calibrate import device_figures
    from meshplan.sim.simulate import simulate
    figures = device_figures(device)
    dev = cluster.device
    peaks = {k: v * 1e12 for k, v in figures["matmul_tflops"].items()}
    measured = replace(dev, peak_flops=peaks, mem_bandwidth=figures["copy_gbps"] * 1e9,
                       efficiency=1.0, memory_efficiency=1.0)
    again = simulate(_one_device_plan(spec, replace(cluster, device=measured)))
    return Check("b", "calibrated", "info",
                 f"measured matmul {', '.join(f'{k} {v:.0f}' for k, v in figures['matmul_tflops'].items())}"
                 f" TFLOP/s, copy {figures['copy_gbps']:.0f} GB/s (preset: "
                 f"{', '.join(f'{k} {dev.matmul_flops(k) / 1e12:.0f}' for k, _ in dev.peak_flops)}"
                 f" TFLOP/s effective, {dev.effective_mem_bandwidth / 1e9:.0f} GB/s); simulated "
                 f"on them {again.step_time_s * 1e3:.1f} ms "
                 f"(x{step_s / again.step_time_s:.2f} of measured)")


# ---------------------------------------------------------------- (c) launch
def check_launch(device: torch.device) -> list[Check]:
    """(c): ``meshplan run --nproc 1 examples/train.py`` with a checkpoint, resumed, against
    the same loop on one device."""
    import meshplan
    from meshplan.zoo.spec import build_workload
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "examples", "train.py")
    if not os.path.isfile(script):
        return [Check("c", "meshplan run", "skip", f"{script} is not in this checkout")]
    spec = "gpt:hidden=64,layers=2,heads=4,seq=16,vocab=128,batch=8"
    w = build_workload(spec, device="meta")
    plan = meshplan.plan(w.model, w.loss_fn, "adamw", w.example_batch, "local:1",
                         mesh_shape=(1, 1), method="data", name=spec, memory_budget_gb=0)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "plan.json")
        plan.save(path)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
             os.environ.get("PYTHONPATH", "")])}
        runs = []
        for steps in (2, 4):   # two steps, saved; resumed from the checkpoint for two more
            losses = os.path.join(tmp, f"losses-{steps}.json")
            cmd = [sys.executable, "-m", "meshplan", "run", "--nproc", "1", "--device",
                   device.type, script, path, "--steps", str(steps), "--losses", losses,
                   "--checkpoint", os.path.join(tmp, "ck")]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                return [Check("c", "meshplan run --nproc 1", "fail",
                              (done.stderr.strip().splitlines() or ["no output"])[-1])]
            with open(losses) as f:
                runs.append({int(k): v for k, v in json.load(f).items()})
    got = {**runs[0], **runs[1]}
    want = _train_py_reference(spec, 4, device)
    same = sorted(got) == list(range(4)) and \
        all(abs(got[k] - want[k]) <= 1e-5 * abs(want[k]) for k in range(4))
    backend = "NCCL beside gloo" if device.type == "cuda" else "gloo"
    return [Check("c", f"meshplan run --nproc 1 ({backend})", "pass" if same else "fail",
                  f"4 AdamW steps, saved after 2 and resumed, losses "
                  f"{', '.join(f'{got[k]:.5f}' for k in sorted(got))}: "
                  f"{'those of one device' if same else f'one device: {want}'}")]


def _train_py_reference(spec: str, steps: int, device: torch.device) -> list[float]:
    """``examples/train.py``'s loop on one device without meshplan (AdamW lr 1e-3 on the
    seeded model, the batch of step k seeded 1 + k)."""
    from meshplan.capture.batch import flatten_batch, step_loss
    from meshplan.zoo.spec import build_workload
    w = build_workload(spec, device="cpu", seed=0)
    model = w.model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for step in range(steps):
        layout, tensors = flatten_batch(build_workload(spec, device="cpu",
                                                       seed=1 + step).example_batch)
        args, kwargs, target = layout.call([t.to(device) for t in tensors.values()])
        loss = step_loss(w.loss_fn, model(*args, **kwargs), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


# ---------------------------------------------------------------- the report
def _header(device: torch.device) -> list[str]:
    import platform
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    cuda = torch.version.cuda or "none"
    return [f"- device: {name}", f"- torch {torch.__version__}, CUDA {cuda}",
            f"- run: `python -m meshplan.gpu_check --device {device.type}` on "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"]


def report(device: torch.device, checks: list[Check], seconds: float) -> str:
    lines = ["# meshplan on a GPU (`make gpu-check`)", "", *_header(device),
             f"- took {seconds:.0f} s", "",
             "| part | check | result | detail |", "|---|---|---|---|"]
    lines += [f"| {c.part} | {c.name} | {c.status} | {c.detail} |" for c in checks]
    return "\n".join(lines) + "\n"


def run(device: torch.device, parts: str = "abc") -> list[Check]:
    checks: list[Check] = []
    steps: dict[str, Callable[[torch.device], Iterable[Check]]] = {
        "a": check_equivalence, "b": check_prediction, "c": check_launch}
    if device.type == "cuda":   # the oracle is fp32: no TF32 in either run
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    for part in "abc":
        if part not in parts:
            checks.append(Check(part, "-", "skip", "not asked for (--parts)"))
            continue
        try:
            for c in steps[part](device):
                checks.append(c)
                _say(c)
        except Exception as e:   # report it and go on: the other parts still tell something
            checks.append(Check(part, "-", "fail", f"{type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''}"))
            _say(checks[-1])
    return checks


def _say(c: Check) -> None:
    print(f"({c.part}) {c.status:<4}  {c.name}: {c.detail}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m meshplan.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None,
                   help="the markdown report (default: docs/gpu.md on a GPU, none on the CPU)")
    p.add_argument("--parts", default="abc", help="which of a, b, c to run (default: all)")
    p.add_argument("--profile-dir", default=None,
                   help="write (b)'s profiled steps there: op tables and Chrome traces")
    args = p.parse_args(argv)
    global PROFILE_DIR
    PROFILE_DIR = args.profile_dir
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda, but this torch sees no GPU: nothing ran", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    started = time.perf_counter()
    print("\n".join(_header(device)), flush=True)
    checks = run(device, args.parts)
    text = report(device, checks, time.perf_counter() - started)
    out = args.out or ("docs/gpu.md" if device.type == "cuda" else None)
    if out:
        with open(out, "w") as f:
            f.write(text)
        print(f"written to {out}")
    return 1 if any(c.status == "fail" for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
