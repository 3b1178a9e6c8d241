"""Device types and interconnect links, with presets from published spec sheets.

Units: FLOP/s, bytes, bytes/s and seconds throughout. Vendors quote HBM capacities in "GB" that are
really GiB (an A100-40GB holds 40·2^30 bytes), while bandwidths are decimal (900 GB/s = 900·10^9
B/s); the presets follow that convention and so does the YAML schema in `meshplan.cost.cluster`.
All peaks are dense (no structured sparsity). Numbers come from `shared/reference/perf_tables.md`
§4 and the vendors' data sheets; `meshplan calibrate` replaces them with measured figures.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TypeVar

from meshplan.cost.checks import check_nonnegative, check_positive

_T = TypeVar("_T")

DTYPE_NAMES: tuple[str, ...] = ("float32", "float16", "bfloat16")

GIB = 2.0**30


def gbps(value: float) -> float:
    """Convert decimal GB/s to bytes/s (the YAML schema's `*_gbps` keys use this)."""
    return value * 1e9


def microseconds(value: float) -> float:
    """Convert microseconds to seconds (the YAML schema's `latency_us` keys use this)."""
    return value / 1e6


def _fraction(value: object, what: str) -> float:
    value = check_positive(value, what)
    if value > 1.0:
        raise ValueError(f"{what} must be in (0, 1], got {value!r}")
    return value


def _per_dtype(value: object, what: str, owner: str) -> tuple[tuple[str, float], ...]:
    """A Mapping dtype -> number (or pairs) as sorted pairs; ValueError on an unknown dtype."""
    pairs = value.items() if isinstance(value, Mapping) else value
    out = tuple(sorted((str(k), check_positive(v, f"{what}[{k!r}]")) for k, v in pairs))
    unknown = [k for k, _ in out if k not in DTYPE_NAMES]
    if unknown:
        raise ValueError(f"DeviceType {owner!r}: unknown dtypes {unknown} in {what}; "
                         f"valid: {list(DTYPE_NAMES)}")
    return out


@dataclass(frozen=True)
class DeviceType:
    """One kind of accelerator.

    `peak_flops` maps a dtype name ("float32", "float16", "bfloat16") to dense peak FLOP/s; it may be
    given as a Mapping and is stored as a sorted tuple of pairs so the type stays hashable.
    `memory_bytes` is device memory in bytes, `mem_bandwidth` its peak bandwidth in bytes/s.
    `efficiency` is the fraction of peak that large matmuls reach, in (0, 1]: one number for
    every dtype, or a Mapping dtype -> fraction (stored as pairs; a dtype it leaves out gets the
    smallest given). `memory_efficiency` is the fraction of `mem_bandwidth` that memory-bound
    ops reach. The presets' figures and where they come from: `docs/calibration.md`. Raises
    TypeError/ValueError on bad fields.
    """

    name: str
    peak_flops: tuple[tuple[str, float], ...]
    memory_bytes: float
    mem_bandwidth: float
    efficiency: float | tuple[tuple[str, float], ...]
    memory_efficiency: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"DeviceType name must be a non-empty string, got {self.name!r}")
        peaks = _per_dtype(self.peak_flops, "peak_flops", self.name)
        if not peaks:
            raise ValueError(f"DeviceType {self.name!r}: peak_flops needs one of {list(DTYPE_NAMES)}")
        object.__setattr__(self, "peak_flops", peaks)
        object.__setattr__(self, "memory_bytes", check_positive(self.memory_bytes, "memory_bytes"))
        object.__setattr__(self, "mem_bandwidth", check_positive(self.mem_bandwidth, "mem_bandwidth"))
        if isinstance(self.efficiency, (Mapping, tuple, list)):
            effs = _per_dtype(self.efficiency, "efficiency", self.name)
            if not effs:
                raise ValueError(f"DeviceType {self.name!r}: efficiency needs at least one dtype")
            for k, v in effs:
                _fraction(v, f"efficiency[{k!r}]")
            if len({v for _, v in effs}) == 1 and {k for k, _ in effs} >= {k for k, _ in peaks}:
                effs = effs[0][1]  # one figure for every dtype: stored as the plain number
        else:
            effs = _fraction(self.efficiency, "efficiency")
        object.__setattr__(self, "efficiency", effs)
        object.__setattr__(self, "memory_efficiency",
                           _fraction(self.memory_efficiency, "memory_efficiency"))

    def peak(self, dtype_name: str) -> float:
        """Dense peak FLOP/s for `dtype_name`; ValueError naming the dtypes this device knows."""
        for name, value in self.peak_flops:
            if name == dtype_name:
                return value
        known = [name for name, _ in self.peak_flops]
        raise ValueError(f"device {self.name!r} has no peak for dtype {dtype_name!r}; known: {known}")

    def matmul_efficiency(self, dtype_name: str) -> float:
        """The fraction of `peak(dtype_name)` large matmuls reach (the smallest figure given
        when `efficiency` names other dtypes only: an uncalibrated dtype is not assumed fast)."""
        if not isinstance(self.efficiency, tuple):
            return self.efficiency
        effs = dict(self.efficiency)
        return effs.get(dtype_name, min(effs.values()))

    def matmul_flops(self, dtype_name: str) -> float:
        """FLOP/s large matmuls reach at `dtype_name`: peak × efficiency."""
        return self.peak(dtype_name) * self.matmul_efficiency(dtype_name)

    @property
    def effective_mem_bandwidth(self) -> float:
        """Bytes/s memory-bound ops reach: `mem_bandwidth` × `memory_efficiency`."""
        return self.mem_bandwidth * self.memory_efficiency

    @property
    def figures(self) -> tuple:
        """What the cost model reads of the device: each dtype's `matmul_flops`, the
        `effective_mem_bandwidth` and the memory. Types of equal figures price every plan alike
        (a mixed cluster's `bottleneck_device` and its slowest type: HAP's P100)."""
        return (tuple((d, self.matmul_flops(d)) for d, _ in self.peak_flops),
                self.effective_mem_bandwidth, self.memory_bytes)


def bottleneck_device(types: Iterable[DeviceType]) -> DeviceType:
    """The device even shards run as on a mix of ``types``: each dtype's matmul FLOP/s, memory
    bandwidth and memory are the smallest among them (a synchronous step waits for the slowest
    device; an even share must fit the smallest memory), with efficiencies folded in (1.0).
    Dtypes some type lacks are left out. The type itself when ``types`` hold one. Raises
    ValueError for no types or no dtype all of them know."""
    kinds = tuple(dict.fromkeys(types))
    if not kinds:
        raise ValueError("bottleneck_device needs at least one device type")
    if len(kinds) == 1:
        return kinds[0]
    shared = [d for d, _ in kinds[0].peak_flops
              if all(d in dict(k.peak_flops) for k in kinds[1:])]
    if not shared:
        raise ValueError(f"device types {[k.name for k in kinds]} share no dtype")
    return DeviceType(
        "slowest of " + "+".join(k.name for k in kinds),
        {d: min(k.matmul_flops(d) for k in kinds) for d in shared},
        min(k.memory_bytes for k in kinds),
        min(k.effective_mem_bandwidth for k in kinds), 1.0, 1.0)


@dataclass(frozen=True)
class Link:
    """An interconnect level: nominal `bandwidth` in bytes/s (one direction), `latency` in
    seconds (≥ 0), and `efficiency`, the fraction of the nominal bandwidth that collectives and
    transfers reach on it, in (0, 1] (NCCL's bus bandwidth over the wire's).

    Intra-host links are per device (what one device's ring traffic gets); inter-host links are
    per host (all of a host's NICs together) — `meshplan.cost.mesh` divides the latter among the
    collective groups that share a host. Raises TypeError/ValueError on bad fields.
    """

    bandwidth: float
    latency: float
    efficiency: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "bandwidth", check_positive(self.bandwidth, "Link.bandwidth"))
        object.__setattr__(self, "latency", check_nonnegative(self.latency, "Link.latency"))
        object.__setattr__(self, "efficiency", _fraction(self.efficiency, "Link.efficiency"))

    @property
    def effective_bandwidth(self) -> float:
        """Bytes/s a collective or a transfer moves: `bandwidth` × `efficiency`."""
        return self.bandwidth * self.efficiency


# Efficiency figures (docs/calibration.md says where each comes from and how to refit them).
# Large fp16/bf16 matmuls: fitted once per device type on one published run
# (benchmarks/calibrate_devices.py); the same chip in another memory size shares its figure.
_A100_HALF = 0.64  # from Megatron-LM's 1.7B row (32 A100s, data parallel; its all-reduce overlapped)
_V100_HALF = 0.70  # from Alpa's 350M row (one V100, no communication)
# Device types without a published run to fit on, and fp32 everywhere (no published fp32 row
# with its per-GPU throughput): 0.6, below every fitted half figure. Megatron reaches 44-52 %
# of peak end to end (perf_tables.md §1), so large matmuls alone sit above that.
_UNFITTED = 0.6
# Memory-bound ops: 1, on the op-by-op traffic the cost model counts. The published runs fuse
# elementwise chains (scale-mask-softmax, bias-GeLU, bias-dropout-add), which move fewer bytes
# at below-peak bandwidth; lower figures leave the fitted matmul efficiencies implausibly high
# (V100 above 0.95 at 0.85). docs/calibration.md has the sensitivity.
_HBM = 1.0


# H200: from a measured bf16 GPT-1.3B step (`make gpu-check`, 2026-11-29; docs/calibration.md):
# its matmul kernels ran 64.5 TFLOP in 80.0 ms (0.815 of the 989 peak); its memory-bound kernels
# took 1.7 times what the op-by-op traffic costs at the 0.85 a plain copy reached, so 0.49 (PyTorch's
# elementwise kernels below copy speed, backward traffic the model leaves out). H100-SXM, the
# same chip with less and slower memory, keeps the unfitted figures until it is measured.
_H200_HALF = 0.81
_H200_HBM = 0.49


def _gpu(name: str, fp32_tf: float, half_tf: float, bf16: bool, mem_gib: float, bw_gbps: float,
         half_efficiency: float = _UNFITTED, hbm_efficiency: float = _HBM) -> DeviceType:
    peaks = {"float32": fp32_tf * 1e12, "float16": half_tf * 1e12}
    effs = {"float32": _UNFITTED, "float16": half_efficiency}
    if bf16:
        peaks["bfloat16"] = half_tf * 1e12
        effs["bfloat16"] = half_efficiency
    return DeviceType(name, peaks, mem_gib * GIB, gbps(bw_gbps), effs,
                      memory_efficiency=hbm_efficiency)


# Strict fp32 peaks (no TF32: PyTorch leaves TF32 matmul off by default). P100/V100/T4 have no bf16.
_DEVICE_LIST: tuple[DeviceType, ...] = (
    _gpu("P100-SXM2-16GB", 10.6, 21.2, False, 16, 732),
    _gpu("V100-SXM2-16GB", 15.7, 125, False, 16, 900, _V100_HALF),
    _gpu("V100-SXM2-32GB", 15.7, 125, False, 32, 900, _V100_HALF),
    _gpu("T4", 8.1, 65, False, 16, 320),
    _gpu("A100-SXM4-40GB", 19.5, 312, True, 40, 1555, _A100_HALF),
    _gpu("A100-SXM4-80GB", 19.5, 312, True, 80, 2039, _A100_HALF),
    _gpu("H100-SXM", 67, 989, True, 80, 3350),
    _gpu("H200", 67, 989, True, 141, 4800, _H200_HALF, _H200_HBM),
    # A modest CPU core running one test process; half types get no speed-up without AMX.
    DeviceType(
        "cpu",
        {"float32": 50e9, "float16": 50e9, "bfloat16": 50e9},
        16 * GIB,
        gbps(20),
        efficiency=0.8,
    ),
)

DEVICE_TYPES: Mapping[str, DeviceType] = MappingProxyType({d.name: d for d in _DEVICE_LIST})

# Nominal bandwidths (perf_tables.md §4) with the fraction collectives reach on them.
_NVSWITCH = 0.78  # A100 node all-reduce bus bandwidth 235 GB/s of NVLink3's 300 (perf_tables §4)
_RDMA = 0.85  # p4d's EFA: ~340 of 400 Gb/s effective (perf_tables §4); taken for InfiniBand too

LINKS: Mapping[str, Link] = MappingProxyType(
    {
        # NVLink2 peak is 6 links x 25 GB/s = 150 GB/s per V100, but the hybrid cube-mesh of a
        # p3.16xlarge / DGX-1 has no switch, so NCCL rings cannot keep every link busy; ~87 %
        # (130 GB/s) is our estimate, a little above NVSwitch's measured 78 %.
        "nvlink-v100": Link(gbps(150), microseconds(5), 0.87),
        # NVLink3/4 peaks per GPU through NVSwitch.
        "nvlink3": Link(gbps(300), microseconds(5), _NVSWITCH),
        "nvlink4": Link(gbps(450), microseconds(5), _NVSWITCH),
        "pcie3": Link(gbps(16), microseconds(10), 0.75),  # ~16 GB/s x16 peak, ~12 achieved
        "ib-hdr": Link(gbps(25), microseconds(10), _RDMA),  # one 200 Gb/s HDR port
        "dgx-a100-ib": Link(gbps(200), microseconds(10), _RDMA),  # 8 x 200 Gb/s per host
        "dgx-h100-ib": Link(gbps(400), microseconds(10), _RDMA),  # 8 x 400 Gb/s per host
        # 25 Gb/s Ethernet per host (p3.16xlarge), NCCL over TCP sockets: as RDMA (estimate).
        "25gbe": Link(gbps(3.125), microseconds(50), _RDMA),
        "loopback": Link(gbps(5), microseconds(20)),  # gloo between processes on one machine
    }
)


def _lookup(table: Mapping[str, _T], name: str, what: str) -> _T:
    if not isinstance(name, str):
        raise TypeError(f"{what} name must be a string, got {name!r}")
    for key, value in table.items():
        if key.lower() == name.lower():
            return value
    raise ValueError(f"unknown {what} {name!r}; known: {sorted(table)}")


def device_type(name: str) -> DeviceType:
    """The preset DeviceType called `name` (case-insensitive); ValueError listing the presets."""
    return _lookup(DEVICE_TYPES, name, "device type")


def link_preset(name: str) -> Link:
    """The preset Link called `name` (case-insensitive); ValueError listing the presets."""
    return _lookup(LINKS, name, "link")


def link_name(link: Link) -> str | None:
    """The name of the preset equal to `link`, or None if it matches no preset."""
    return next((name for name, preset in LINKS.items() if preset == link), None)
