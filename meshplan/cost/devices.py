"""Device types and interconnect links, with presets from published spec sheets.

Units: FLOP/s, bytes, bytes/s and seconds throughout. Vendors quote HBM capacities in "GB" that are
really GiB (an A100-40GB holds 40·2^30 bytes), while bandwidths are decimal (900 GB/s = 900·10^9
B/s); the presets follow that convention and so does the YAML schema in `meshplan.cost.cluster`.
All peaks are dense (no structured sparsity). Numbers come from `shared/reference/perf_tables.md`
§4 and the vendors' data sheets; `meshplan calibrate` replaces them with measured figures.
"""

from __future__ import annotations

from collections.abc import Mapping
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


@dataclass(frozen=True)
class DeviceType:
    """One kind of accelerator.

    `peak_flops` maps a dtype name ("float32", "float16", "bfloat16") to dense peak FLOP/s; it may be
    given as a Mapping and is stored as a sorted tuple of pairs so the type stays hashable.
    `memory_bytes` is device memory in bytes, `mem_bandwidth` in bytes/s, `efficiency` the fraction
    of peak that large matmuls reach, in (0, 1]. Raises TypeError/ValueError on bad fields.
    """

    name: str
    peak_flops: tuple[tuple[str, float], ...]
    memory_bytes: float
    mem_bandwidth: float
    efficiency: float

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"DeviceType name must be a non-empty string, got {self.name!r}")
        pairs = self.peak_flops.items() if isinstance(self.peak_flops, Mapping) else self.peak_flops
        peaks = tuple(sorted((str(k), check_positive(v, f"peak_flops[{k!r}]")) for k, v in pairs))
        unknown = [k for k, _ in peaks if k not in DTYPE_NAMES]
        if unknown:
            raise ValueError(
                f"DeviceType {self.name!r}: unknown dtypes {unknown} in peak_flops; valid: {list(DTYPE_NAMES)}"
            )
        if not peaks:
            raise ValueError(f"DeviceType {self.name!r}: peak_flops needs one of {list(DTYPE_NAMES)}")
        object.__setattr__(self, "peak_flops", peaks)
        object.__setattr__(self, "memory_bytes", check_positive(self.memory_bytes, "memory_bytes"))
        object.__setattr__(self, "mem_bandwidth", check_positive(self.mem_bandwidth, "mem_bandwidth"))
        eff = check_positive(self.efficiency, "efficiency")
        if eff > 1.0:
            raise ValueError(f"efficiency must be in (0, 1], got {eff!r}")
        object.__setattr__(self, "efficiency", eff)

    def peak(self, dtype_name: str) -> float:
        """Dense peak FLOP/s for `dtype_name`; ValueError naming the dtypes this device knows."""
        for name, value in self.peak_flops:
            if name == dtype_name:
                return value
        known = [name for name, _ in self.peak_flops]
        raise ValueError(f"device {self.name!r} has no peak for dtype {dtype_name!r}; known: {known}")


@dataclass(frozen=True)
class Link:
    """An interconnect level: `bandwidth` in bytes/s (one direction), `latency` in seconds (≥ 0).

    Intra-host links are per device (what one device's ring traffic gets); inter-host links are
    per host (all of a host's NICs together) — `meshplan.cost.mesh` divides the latter among the
    collective groups that share a host. Raises TypeError/ValueError on bad fields.
    """

    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "bandwidth", check_positive(self.bandwidth, "Link.bandwidth"))
        object.__setattr__(self, "latency", check_nonnegative(self.latency, "Link.latency"))


def _gpu(name: str, fp32_tf: float, half_tf: float, bf16: bool, mem_gib: float, bw_gbps: float) -> DeviceType:
    peaks = {"float32": fp32_tf * 1e12, "float16": half_tf * 1e12}
    if bf16:
        peaks["bfloat16"] = half_tf * 1e12
    # 0.6: Megatron reaches 44-52 % of peak end to end (perf_tables.md §1), communication and
    # non-matmul ops included, so large matmuls alone sit above that; calibration refines it.
    return DeviceType(name, peaks, mem_gib * GIB, gbps(bw_gbps), efficiency=0.6)


# Strict fp32 peaks (no TF32: PyTorch leaves TF32 matmul off by default). P100/V100/T4 have no bf16.
_DEVICE_LIST: tuple[DeviceType, ...] = (
    _gpu("P100-SXM2-16GB", 10.6, 21.2, False, 16, 732),
    _gpu("V100-SXM2-16GB", 15.7, 125, False, 16, 900),
    _gpu("V100-SXM2-32GB", 15.7, 125, False, 32, 900),
    _gpu("T4", 8.1, 65, False, 16, 320),
    _gpu("A100-SXM4-40GB", 19.5, 312, True, 40, 1555),
    _gpu("A100-SXM4-80GB", 19.5, 312, True, 80, 2039),
    _gpu("H100-SXM", 67, 989, True, 80, 3350),
    _gpu("H200", 67, 989, True, 141, 4800),
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

LINKS: Mapping[str, Link] = MappingProxyType(
    {
        # NVLink2 peak is 6 links x 25 GB/s = 150 GB/s per V100, but the hybrid cube-mesh of a
        # p3.16xlarge / DGX-1 has no switch, so NCCL rings cannot keep every link busy; 130 GB/s
        # (~87 % of peak, like the ~80 % measured for NVLink3 in perf_tables.md) is our estimate.
        "nvlink-v100": Link(gbps(130), microseconds(5)),
        # NVLink3/4 peaks per GPU through NVSwitch; measured bus bandwidth is ~80 % of these.
        "nvlink3": Link(gbps(300), microseconds(5)),
        "nvlink4": Link(gbps(450), microseconds(5)),
        "pcie3": Link(gbps(12), microseconds(10)),  # ~16 GB/s x16 peak, ~12 achieved
        "ib-hdr": Link(gbps(25), microseconds(10)),  # one 200 Gb/s HDR port
        "dgx-a100-ib": Link(gbps(200), microseconds(10)),  # 8 x 200 Gb/s per host
        "dgx-h100-ib": Link(gbps(400), microseconds(10)),  # 8 x 400 Gb/s per host
        "25gbe": Link(gbps(3.125), microseconds(50)),  # 25 Gb/s Ethernet per host
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
