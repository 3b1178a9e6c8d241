"""The cluster: hosts × devices of one type, with one link inside a host and one between hosts.

A cluster comes from a spec string (`parse_cluster_spec`): a YAML file path, `local:N`,
`PRESET:H` (H hosts of the preset) or `PRESET:HxK` (H hosts, K of each host's devices).

YAML schema (every key required, no other key allowed)::

    name: two-v100-hosts        # any non-empty string
    hosts: 2                    # int > 0
    devices_per_host: 8         # int > 0
    device: V100-SXM2-16GB      # a preset name (see devices.DEVICE_TYPES), or a mapping:
    #   name: my-gpu
    #   peak_tflops: {float32: 15.7, float16: 125}   # dense TFLOP/s per dtype (float32/float16/bfloat16)
    #   memory_gb: 16                                # GiB (2^30 bytes), as vendors' HBM "GB"
    #   mem_bandwidth_gbps: 900                      # GB/s (10^9 bytes/s)
    #   efficiency: 0.6                              # fraction of peak reached by big matmuls, (0, 1],
    #                                                # or per dtype: {float32: 0.6, float16: 0.7}
    #   memory_efficiency: 0.85                      # optional (default 1): fraction of the memory
    #                                                # bandwidth memory-bound ops reach, (0, 1]
    intra_host: nvlink-v100     # a preset name (see devices.LINKS), or a mapping:
    #   bandwidth_gbps: 150     # GB/s per device, one direction (nominal)
    #   latency_us: 5           # microseconds, >= 0
    #   efficiency: 0.87        # optional (default 1): fraction of the bandwidth collectives reach
    inter_host: {bandwidth_gbps: 3.125, latency_us: 50}   # same forms; bandwidth per host

A cluster of mixed device types (HAP's: V100 hosts and P100 hosts) gives ``hosts`` as a list of
host groups instead of a count, and no top-level ``device``::

    hosts:
      - {count: 2, device: V100-SXM2-16GB}     # 2 hosts, each device of this type
      - {count: 6, device: P100-SXM2-16GB}
      - {count: 1, device: [V100-SXM2-16GB, V100-SXM2-16GB, P100-SXM2-16GB, ...]}
        # one type per device of the host (devices_per_host of them)

Planned as one type, such a cluster is its `bottleneck_device` (an even share runs at the
slowest device's pace and must fit the smallest memory).

Malformed input raises ValueError naming the file, the key and what was expected.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

import yaml

from meshplan.cost.checks import check_count, check_keys, fail, number, positive_int
from meshplan.cost.devices import (
    DEVICE_TYPES,
    DTYPE_NAMES,
    GIB,
    LINKS,
    DeviceType,
    Link,
    bottleneck_device,
    device_type,
    gbps,
    link_name,
    link_preset,
    microseconds,
)


@dataclass(frozen=True)
class Cluster:
    """`num_hosts` hosts of `devices_per_host` devices of type `device`.

    `intra_host` links devices of one host (bandwidth per device); `inter_host` links hosts
    (bandwidth per host). Devices are numbered host-major. A cluster of mixed types lists each
    device's in `device_types` (host-major; `mixed_cluster` builds one), and its `device` is
    their `bottleneck_device`, what plans of even shards run as. Raises TypeError/ValueError on
    bad fields.
    """

    name: str
    num_hosts: int
    devices_per_host: int
    device: DeviceType
    intra_host: Link
    inter_host: Link
    device_types: tuple[DeviceType, ...] = ()   # () = every device is `device`

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Cluster name must be a non-empty string, got {self.name!r}")
        check_count(self.num_hosts, "Cluster.num_hosts")
        check_count(self.devices_per_host, "Cluster.devices_per_host")
        if not isinstance(self.device, DeviceType):
            raise TypeError(f"Cluster.device must be a DeviceType, got {self.device!r}")
        for field in ("intra_host", "inter_host"):
            if not isinstance(getattr(self, field), Link):
                raise TypeError(f"Cluster.{field} must be a Link, got {getattr(self, field)!r}")
        if self.device_types:
            types = tuple(self.device_types)
            object.__setattr__(self, "device_types", types)
            if len(types) != self.num_devices:
                raise ValueError(f"Cluster.device_types lists {len(types)} devices; the cluster "
                                 f"has {self.num_hosts} x {self.devices_per_host}")
            if not all(isinstance(t, DeviceType) for t in types):
                raise TypeError("Cluster.device_types must hold DeviceTypes")
            if self.device != bottleneck_device(types):
                raise ValueError("Cluster.device of a mixed cluster must be the "
                                 "bottleneck_device of its device_types")

    @property
    def types(self) -> tuple[DeviceType, ...]:
        """Each device's type, host-major."""
        return self.device_types or (self.device,) * self.num_devices

    def submesh(self, name: str, num_hosts: int, devices_per_host: int) -> "Cluster":
        """A part of this cluster of ``num_hosts`` x ``devices_per_host`` devices, with its
        links. Of a mixed cluster, the part is of its bottleneck type: which devices a stage
        gets is decided after it is priced."""
        return replace(self, name=name, num_hosts=num_hosts, devices_per_host=devices_per_host,
                       device_types=())

    @property
    def is_mixed(self) -> bool:
        """Whether the devices are of more than one type."""
        return len(set(self.types)) > 1

    @property
    def num_devices(self) -> int:
        """Total number of devices."""
        return self.num_hosts * self.devices_per_host

    def default_mesh_shape(self) -> tuple[int, int]:
        """(num_hosts, devices_per_host): the mesh whose fast axis 1 stays inside each host."""
        return (self.num_hosts, self.devices_per_host)


@dataclass(frozen=True)
class _Preset:
    device: str
    devices_per_host: int | None  # None: as many as asked (local processes)
    intra_host: str
    inter_host: str


CLUSTER_PRESETS: Mapping[str, _Preset] = MappingProxyType(
    {
        "local": _Preset("cpu", None, "loopback", "loopback"),
        "p3.16xlarge": _Preset("V100-SXM2-16GB", 8, "nvlink-v100", "25gbe"),
        "dgx-a100": _Preset("A100-SXM4-80GB", 8, "nvlink3", "dgx-a100-ib"),
        "dgx-h100": _Preset("H100-SXM", 8, "nvlink4", "dgx-h100-ib"),
    }
)

_SPEC_FORMS = "a YAML file path (*.yaml), local:N, PRESET:H or PRESET:HxK"


def preset_cluster(preset: str, num_hosts: int, devices_per_host: int | None = None) -> Cluster:
    """Cluster of `num_hosts` hosts of preset `preset` (see CLUSTER_PRESETS), using
    `devices_per_host` of each host's devices (default: all). `local` allows one host only.
    Raises ValueError for an unknown preset or a count the preset cannot hold."""
    if preset not in CLUSTER_PRESETS:
        raise ValueError(f"unknown cluster preset {preset!r}; valid presets: {sorted(CLUSTER_PRESETS)}")
    spec = CLUSTER_PRESETS[preset]
    per_host = spec.devices_per_host if devices_per_host is None else devices_per_host
    if per_host is None:
        raise ValueError(f"preset {preset!r} needs an explicit device count, e.g. {preset}:4")
    check_count(num_hosts, "num_hosts")
    check_count(per_host, "devices_per_host")
    if spec.devices_per_host is not None and per_host > spec.devices_per_host:
        raise ValueError(
            f"preset {preset!r} has {spec.devices_per_host} devices per host, asked for {per_host}"
        )
    if spec.devices_per_host is None and num_hosts != 1:
        raise ValueError(f"preset {preset!r} is one machine: hosts must be 1, got {num_hosts}")
    return Cluster(
        f"{preset}:{num_hosts}x{per_host}",
        num_hosts,
        per_host,
        device_type(spec.device),
        link_preset(spec.intra_host),
        link_preset(spec.inter_host),
    )


def mixed_cluster(name: str, host_types: Sequence[Sequence[DeviceType]], intra_host: Link,
                  inter_host: Link) -> Cluster:
    """A cluster whose host h has devices of the types ``host_types[h]`` (every host as many).
    Raises ValueError for no hosts or hosts of different sizes."""
    hosts = [tuple(h) for h in host_types]
    if not hosts or not hosts[0]:
        raise ValueError("mixed_cluster needs at least one host with at least one device")
    if len({len(h) for h in hosts}) != 1:
        raise ValueError(f"every host needs the same number of devices, got "
                         f"{[len(h) for h in hosts]}")
    types = tuple(t for h in hosts for t in h)
    return Cluster(name, len(hosts), len(hosts[0]), bottleneck_device(types), intra_host,
                   inter_host, types if len(set(types)) > 1 else ())


def local_cluster(num_devices: int) -> Cluster:
    """One host running `num_devices` CPU processes joined by loopback links."""
    return preset_cluster("local", 1, num_devices)


def _parse_spec_count(text: str, spec: str) -> tuple[int, int | None]:
    match = re.fullmatch(r"\s*([1-9]\d*)\s*(?:[xX]\s*([1-9]\d*)\s*)?", text, re.ASCII)
    if match is None:
        raise ValueError(
            f"bad device count {text!r} in cluster spec {spec!r}: expected N or HxK with positive "
            f"integers; valid forms: {_SPEC_FORMS}"
        )
    hosts, per_host = match.groups()
    return (int(hosts), None if per_host is None else int(per_host))


def parse_cluster_spec(spec: str) -> Cluster:
    """Cluster from SPEC: a YAML file path, `local:N`, `PRESET:H` or `PRESET:HxK`.

    Raises TypeError if `spec` is not a string, ValueError naming the bad part, the valid presets
    and the valid forms otherwise (and the load_cluster_yaml errors for files)."""
    if not isinstance(spec, str):
        raise TypeError(f"cluster spec must be a string, got {spec!r}")
    if spec.endswith((".yaml", ".yml")) or os.path.isfile(spec):
        return load_cluster_yaml(spec)
    preset, sep, count = spec.partition(":")
    preset = preset.strip().lower()
    if not sep or preset not in CLUSTER_PRESETS:
        raise ValueError(
            f"bad cluster spec {spec!r}: valid forms: {_SPEC_FORMS}; "
            f"valid presets: {sorted(CLUSTER_PRESETS)}"
        )
    hosts, per_host = _parse_spec_count(count, spec)
    if preset == "local" and per_host is None:
        hosts, per_host = 1, hosts
    return preset_cluster(preset, hosts, per_host)


# ---------------------------------------------------------------- YAML


def _device_from(data: object, source: str, where: str = "device") -> DeviceType:
    if isinstance(data, str):
        try:
            return device_type(data)
        except ValueError as err:
            expected = f"a device preset in {sorted(DEVICE_TYPES)} or a mapping"
            raise fail(source, where, expected, data) from err
    keys = ("name", "peak_tflops", "memory_gb", "mem_bandwidth_gbps", "efficiency")
    d = check_keys(data, keys, source, where, optional=("memory_efficiency",))
    peaks = d["peak_tflops"]
    if not isinstance(peaks, Mapping) or not peaks:
        raise fail(source, f"{where}.peak_tflops", "a mapping dtype -> TFLOP/s", peaks)
    for dtype in peaks:
        if dtype not in DTYPE_NAMES:
            raise fail(source, f"{where}.peak_tflops.{dtype}", f"a dtype in {list(DTYPE_NAMES)}", dtype)
    flops = {k: number(peaks, k, source, f"{where}.peak_tflops") * 1e12 for k in peaks}
    effs = d["efficiency"]
    if isinstance(effs, Mapping):
        if not effs:
            raise fail(source, f"{where}.efficiency", "a number or a mapping dtype -> number", effs)
        effs = {k: number(effs, k, source, f"{where}.efficiency") for k in effs}
    else:
        effs = number(d, "efficiency", source, where)
    try:
        return DeviceType(
            d["name"],
            flops,
            number(d, "memory_gb", source, where) * GIB,
            gbps(number(d, "mem_bandwidth_gbps", source, where)),
            effs,
            number(d, "memory_efficiency", source, where) if "memory_efficiency" in d else 1.0,
        )
    except (TypeError, ValueError) as err:
        raise ValueError(f"{source}: key {where!r}: {err}") from err


def _link_from(data: object, source: str, key: str) -> Link:
    if isinstance(data, str):
        try:
            return link_preset(data)
        except ValueError as err:
            raise fail(source, key, f"a link preset in {sorted(LINKS)} or a mapping", data) from err
    d = check_keys(data, ("bandwidth_gbps", "latency_us"), source, key, optional=("efficiency",))
    bandwidth = gbps(number(d, "bandwidth_gbps", source, key))
    latency = microseconds(number(d, "latency_us", source, key, allow_zero=True))
    efficiency = number(d, "efficiency", source, key) if "efficiency" in d else 1.0
    try:
        return Link(bandwidth, latency, efficiency)
    except ValueError as err:
        raise ValueError(f"{source}: key {key!r}: {err}") from err


def cluster_from_dict(data: object, source: str = "<cluster dict>") -> Cluster:
    """Cluster from the YAML schema above, already parsed into plain Python objects.

    `source` names the file in error messages. Raises ValueError naming the key and what is expected."""
    grouped = isinstance(data, Mapping) and isinstance(data.get("hosts"), list)
    keys = ("name", "hosts", "devices_per_host", "intra_host", "inter_host")
    d = check_keys(data, keys if grouped else keys + ("device",), source, "")
    if not isinstance(d["name"], str) or not d["name"]:
        raise fail(source, "name", "a non-empty string", d["name"])
    per_host = positive_int(d, "devices_per_host", source)
    intra = _link_from(d["intra_host"], source, "intra_host")
    inter = _link_from(d["inter_host"], source, "inter_host")
    if grouped:
        return mixed_cluster(d["name"], _host_types(d["hosts"], per_host, source), intra, inter)
    return Cluster(d["name"], positive_int(d, "hosts", source), per_host,
                   _device_from(d["device"], source), intra, inter)


def _host_types(groups: list, per_host: int, source: str) -> list[tuple[DeviceType, ...]]:
    """Each host's device types from the ``hosts`` list of host groups (module docstring)."""
    if not groups:
        raise fail(source, "hosts", "a host count or a non-empty list of host groups", groups)
    hosts = []
    for i, group in enumerate(groups):
        where = f"hosts[{i}]"
        g = check_keys(group, ("count", "device"), source, where)
        count = positive_int(g, "count", source, where)
        if isinstance(g["device"], list):
            if len(g["device"]) != per_host:
                raise fail(source, f"{where}.device", f"one type per device: a list of "
                           f"{per_host} (devices_per_host)", g["device"])
            types = tuple(_device_from(t, source, f"{where}.device[{j}]")
                          for j, t in enumerate(g["device"]))
        else:
            types = (_device_from(g["device"], source, f"{where}.device"),) * per_host
        hosts += [types] * count
    return hosts


def _device_to(device: DeviceType) -> str | dict[str, Any]:
    if DEVICE_TYPES.get(device.name) == device:
        return device.name
    return {
        "name": device.name,
        "peak_tflops": {k: v / 1e12 for k, v in device.peak_flops},
        "memory_gb": device.memory_bytes / GIB,
        "mem_bandwidth_gbps": device.mem_bandwidth / 1e9,
        "efficiency": (dict(device.efficiency) if isinstance(device.efficiency, tuple)
                       else device.efficiency),
        "memory_efficiency": device.memory_efficiency,
    }


def _link_to(link: Link) -> str | dict[str, float]:
    return link_name(link) or {"bandwidth_gbps": link.bandwidth / 1e9,
                               "latency_us": link.latency * 1e6, "efficiency": link.efficiency}


def cluster_to_dict(cluster: Cluster) -> dict[str, Any]:
    """The YAML-schema dict of `cluster`; preset devices and links are written by name (a
    mixed cluster's hosts as groups of equal consecutive hosts)."""
    out: dict[str, Any] = {"name": cluster.name, "hosts": cluster.num_hosts,
                           "devices_per_host": cluster.devices_per_host,
                           "device": _device_to(cluster.device)}
    if cluster.is_mixed:
        del out["device"]
        out["hosts"] = _host_groups(cluster)
    out["intra_host"] = _link_to(cluster.intra_host)
    out["inter_host"] = _link_to(cluster.inter_host)
    return out


def _host_groups(cluster: Cluster) -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = []
    m = cluster.devices_per_host
    for h in range(cluster.num_hosts):
        types = cluster.types[h * m:(h + 1) * m]
        device = _device_to(types[0]) if len(set(types)) == 1 else [_device_to(t) for t in types]
        if groups and groups[-1]["device"] == device:
            groups[-1]["count"] += 1
        else:
            groups.append({"count": 1, "device": device})
    return groups


def dump_cluster_yaml(cluster: Cluster) -> str:
    """`cluster` as YAML text in the schema above."""
    return yaml.safe_dump(cluster_to_dict(cluster), sort_keys=False)


def load_cluster_yaml(path: str | os.PathLike[str]) -> Cluster:
    """Cluster from the YAML file at `path` (schema in this module's docstring).

    Raises ValueError naming the file for an unreadable file, a YAML syntax error, or a bad key."""
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except OSError as err:
        raise ValueError(f"{source}: cannot read cluster file: {err.strerror or err}") from err
    except yaml.YAMLError as err:
        raise ValueError(f"{source}: not valid YAML: {err}") from err
    return cluster_from_dict(data, source)
