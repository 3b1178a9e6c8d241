"""``meshplan calibrate``: measure this machine and write a cluster profile ``--cluster`` takes.

Measured: matmul throughput per dtype (float32, bfloat16) and memory bandwidth (a large copy)
in one process; all-reduce time per message size (1 KiB .. 64 MiB) and group size over the
current backend (gloo here: one process per device, `WorkerPool`). Fitted: per group size the
cost model's own form ``t = α + 2(n - 1)/n · B · β`` (DESIGN.md §4) by least squares on the
*relative* error (each size counts alike, 1 KiB as much as 64 MiB), then one α and β for the
link — the largest group's, which the plans of this machine use. Every fit is reported with
its error per size. Each figure is a median of repeated runs (the machine may be shared),
the all-reduce sizes measured in interleaved sweeps.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

SIZES = tuple(1024 * 4 ** k for k in range(9))   # 1 KiB .. 64 MiB


def _median_seconds(fn: Any, reps: int, device: torch.device = torch.device("cpu")) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()   # warm up
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# One product measured takes at most about this long: a dtype the device computes slowly (bf16
# on a CPU without bf16 units: about 1 GFLOP/s here, 2.6 s for a 1024-square product, 16 s of
# `calibrate`'s run) is measured on a smaller product, the largest power-of-two step from
# `SMALLEST_PRODUCT` whose time stays under it. So slow a unit is far from the sizes where its
# throughput falls; a fast one reaches the size asked.
PRODUCT_SECONDS = 0.1
SMALLEST_PRODUCT = 128


def matmul_tflops(dtype: torch.dtype, n: int = 1024, reps: int = 5,
                  device: torch.device | str = "cpu") -> float:
    """Dense matmul throughput of this process at ``dtype`` on ``device``, TFLOP/s, on
    products of ``n`` squared, or smaller ones where those take over `PRODUCT_SECONDS`."""
    dev = torch.device(device)

    def operands(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(size, size, device=dev).to(dtype),
                torch.randn(size, size, device=dev).to(dtype))

    size = min(n, SMALLEST_PRODUCT)
    a, b = operands(size)
    # A product 8 times as long follows while this size's takes an eighth of the bound.
    while size < n and _median_seconds(lambda: a @ b, 2, dev) * 8 <= PRODUCT_SECONDS:
        size = min(2 * size, n)
        a, b = operands(size)
    return 2 * size ** 3 / _median_seconds(lambda: a @ b, reps, dev) / 1e12


def copy_gbps(nbytes: int = 64 * 2 ** 20, reps: int = 5,
              device: torch.device | str = "cpu") -> float:
    """Memory bandwidth of a large copy (read + write) on ``device``, GB/s."""
    dev = torch.device(device)
    src = torch.empty(nbytes // 4, device=dev)
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_seconds(lambda: dst.copy_(src), reps, dev) / 1e9


def device_figures(device: torch.device | str = "cpu") -> dict[str, Any]:
    """What the cost model needs of one device, measured: matmul TFLOP/s per dtype (large
    square products on a GPU, where small ones cannot fill it) and copy bandwidth."""
    dev = torch.device(device)
    gpu = dev.type == "cuda"
    n, nbytes = (8192, 2 ** 30) if gpu else (1024, 64 * 2 ** 20)
    dtypes = (torch.float32, torch.bfloat16, torch.float16) if gpu else \
        (torch.float32, torch.bfloat16)
    if gpu:   # strict fp32, as the presets' fp32 peaks are
        torch.backends.cuda.matmul.allow_tf32 = False
    tflops = {str(d).removeprefix("torch."): matmul_tflops(d, n, 10 if gpu else 5, dev)
              for d in dtypes}
    return {"matmul_tflops": tflops, "copy_gbps": copy_gbps(nbytes, 10 if gpu else 5, dev)}


def all_reduce_times(rank: int, nprocs: int, sizes: tuple[int, ...],
                     groups: tuple[int, ...], rounds: int = 9) -> dict[int, list[float]]:
    """On a pool worker: per group size (ranks 0..g-1), the median all-reduce seconds of each
    message size (the slowest member's, as a collective ends when its last member does).

    The sizes are measured in ``rounds`` interleaved sweeps and each size's median taken over
    the sweeps: on a shared machine a burst of load then slows one sample of every size, not
    every sample of one size (which no fit of the cost model's form can follow)."""
    out: dict[int, list[float]] = {}
    for g in groups:
        group = dist.new_group(list(range(g)))   # collective: every rank creates it
        samples: list[list[float]] = [[] for _ in sizes]
        for _ in range(rounds):
            for i, nbytes in enumerate(sizes):
                if rank < g:
                    samples[i].append(_burst_seconds(group, nbytes))
        times = []
        for mine in samples:
            slowest = torch.tensor([statistics.median(mine) if mine else 0.0])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            times.append(float(slowest))
        out[g] = times
    return out


def _burst_seconds(group: Any, nbytes: int) -> float:
    """Seconds per all-reduce of ``nbytes`` over ``group`` in one run of back-to-back ones.

    A run, as a step issues them: with more processes than cores, one alone measures the
    scheduler's wake-ups. Each on a tensor of its own, as a step's gradient buckets are: one
    tensor reduced again and again would stay in cache and look faster than a step sees it."""
    inner = max(1, min(32, 2 ** 22 // nbytes))
    device = "cuda" if "nccl" in str(dist.get_backend(group)) else "cpu"
    buffers = [torch.ones(max(nbytes // 4, 1), device=device)
               for _ in range(max(1, min(32, 2 ** 26 // nbytes)))]
    dist.all_reduce(buffers[0], group=group)   # warm up
    dist.barrier(group=group)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(inner):
        dist.all_reduce(buffers[i % len(buffers)], group=group)
    if device == "cuda":   # NCCL returns before the GPU is done
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / inner


@dataclass(frozen=True)
class LinkFit:
    """α (s) and β (s/byte) of one group size, and the relative error at each size."""

    group: int
    alpha: float
    beta: float
    sizes: tuple[int, ...]
    measured: tuple[float, ...]

    def predicted(self, nbytes: float) -> float:
        n = self.group
        return self.alpha + 2 * (n - 1) / n * nbytes * self.beta

    @property
    def errors(self) -> tuple[float, ...]:
        return tuple(self.predicted(b) / t - 1 for b, t in zip(self.sizes, self.measured))


def fit_link(group: int, sizes: tuple[int, ...], measured: list[float]) -> LinkFit:
    """The cost model's all-reduce form fitted to ``measured`` with the smallest worst-case
    relative error (a small LP: minimize e with |α + c_i β - t_i| <= e t_i, α, β >= 0)."""
    n = group
    c = [2 * (n - 1) / n * b for b in sizes]
    # Variables (α, β scaled to seconds per MiB, e); rows: ±(α + c β) - e t <= ±t.
    scale = 2.0 ** 20
    a_ub, b_ub = [], []
    for ci, t in zip(c, measured):
        a_ub.append([1.0, ci / scale, -t])
        b_ub.append(t)
        a_ub.append([-1.0, -ci / scale, -t])
        b_ub.append(-t)
    from scipy.optimize import linprog   # a second of every importer's start, needed here only
    found = linprog([0.0, 0.0, 1.0], A_ub=a_ub, b_ub=b_ub, bounds=[(0, None)] * 3,
                    method="highs")
    if not found.success:
        raise RuntimeError(f"fitting the all-reduce times failed: {found.message}")
    alpha, beta, _ = found.x
    return LinkFit(group, float(alpha), float(beta) / scale, tuple(sizes), tuple(measured))


def profile_yaml(name: str, nprocs: int, tflops: dict[str, float], mem_gbps: float,
                 memory_gb: float, link: LinkFit) -> str:
    """A cluster YAML of one host of ``nprocs`` devices with the measured figures."""
    peak = ", ".join(f"{k}: {v:.6g}" for k, v in tflops.items())
    bandwidth = 1 / link.beta / 1e9 if link.beta > 0 else 1e6
    return (f"# Measured by `meshplan calibrate` on this machine: matmul throughput per dtype,\n"
            f"# copy bandwidth, and all-reduce over {nprocs} processes fitted to\n"
            f"# alpha + 2(n-1)/n * B * beta (max relative error "
            f"{max(abs(e) for e in link.errors):.1%} over {len(link.sizes)} sizes).\n"
            f"name: {name}\nhosts: 1\ndevices_per_host: {nprocs}\n"
            f"device:\n  name: {name}-process\n  peak_tflops: {{{peak}}}\n"
            f"  memory_gb: {memory_gb:.6g}\n  mem_bandwidth_gbps: {mem_gbps:.6g}\n"
            f"  efficiency: 1.0   # the peaks are measured throughput\n"
            f"intra_host: {{bandwidth_gbps: {bandwidth:.6g}, latency_us: "
            f"{link.alpha * 1e6:.6g}}}\n"
            f"inter_host: {{bandwidth_gbps: {bandwidth:.6g}, latency_us: "
            f"{link.alpha * 1e6:.6g}}}\n")


def run_calibration(nprocs: int, output: str, device: str = "cpu"
                    ) -> tuple[str, dict[str, Any]]:
    """Measure, fit and write the profile to ``output`` (module docstring) for ``device``
    ("cpu": processes of this machine over gloo; "cuda": its GPUs, one process each over
    NCCL); returns the report as text and as a JSON-able dict. RuntimeError for "cuda"
    without enough GPUs."""
    from meshplan.runtime.devices import resolve_device
    from meshplan.runtime.pool import WorkerPool   # runtime imports cost: not at import
    dev = resolve_device(device)
    if dev.type == "cuda" and torch.cuda.device_count() < nprocs:
        raise RuntimeError(f"--device cuda measures one process per GPU: {nprocs} asked, "
                           f"{torch.cuda.device_count()} GPUs here")
    figures = device_figures(dev)
    tflops, mem = figures["matmul_tflops"], figures["copy_gbps"]
    groups = tuple(g for g in (2, 4, 8, 16) if g < nprocs) + (nprocs,)
    with WorkerPool(nprocs, device=device) as pool:
        measured = pool.run(all_reduce_times, SIZES, groups)[0]
    fits = {g: fit_link(g, SIZES, measured[g]) for g in groups}
    link = fits[nprocs]
    ram = torch.cuda.get_device_properties(dev).total_memory / 2 ** 30 * nprocs \
        if dev.type == "cuda" else \
        os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    with open(output, "w") as f:
        f.write(profile_yaml("calibrated", nprocs, tflops, mem, ram / nprocs, link))
    lines = ["matmul: " + ", ".join(f"{k} {v:.3f} TFLOP/s" for k, v in tflops.items()),
             f"copy: {mem:.1f} GB/s"]
    for g, fit in fits.items():
        lines.append(f"all-reduce over {g}: alpha {fit.alpha * 1e6:.1f} us, beta -> "
                     f"{1 / fit.beta / 1e9 if fit.beta else float('inf'):.3f} GB/s")
        lines += [f"  {b:>10,} B  measured {t * 1e3:9.3f} ms  predicted "
                  f"{fit.predicted(b) * 1e3:9.3f} ms  error {e:+.1%}"
                  for b, t, e in zip(fit.sizes, fit.measured, fit.errors)]
    report = {"matmul_tflops": tflops, "copy_gbps": mem,
              "all_reduce": {str(g): {"alpha_s": f.alpha, "beta_s_per_byte": f.beta,
                                      "sizes": list(f.sizes), "measured_s": list(f.measured),
                                      "errors": list(f.errors)} for g, f in fits.items()}}
    return "\n".join(lines), report
