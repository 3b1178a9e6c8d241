"""Device/link presets, Cluster validation, spec strings and the YAML schema."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from meshplan.cost.cluster import (
    CLUSTER_PRESETS,
    Cluster,
    cluster_from_dict,
    cluster_to_dict,
    dump_cluster_yaml,
    load_cluster_yaml,
    local_cluster,
    parse_cluster_spec,
    preset_cluster,
)
from meshplan.cost.devices import DEVICE_TYPES, GIB, LINKS, DeviceType, Link, device_type, link_preset

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "clusters" / "two_v100_hosts.yaml"


# ---------------------------------------------------------------- devices and links


@pytest.mark.parametrize(
    ("name", "dtype", "tflops", "mem_gib", "bw_gbps"),
    [
        ("V100-SXM2-16GB", "float16", 125, 16, 900),
        ("V100-SXM2-16GB", "float32", 15.7, 16, 900),
        ("V100-SXM2-32GB", "float16", 125, 32, 900),
        ("A100-SXM4-40GB", "bfloat16", 312, 40, 1555),
        ("A100-SXM4-80GB", "float32", 19.5, 80, 2039),
        ("H100-SXM", "bfloat16", 989, 80, 3350),
        ("H100-SXM", "float32", 67, 80, 3350),
        ("H200", "bfloat16", 989, 141, 4800),
        ("P100-SXM2-16GB", "float16", 21.2, 16, 732),
        ("T4", "float16", 65, 16, 320),
        ("cpu", "float32", 0.05, 16, 20),
    ],
)
def test_device_presets_match_spec_sheets(name: str, dtype: str, tflops: float, mem_gib: int, bw_gbps: float) -> None:
    device = device_type(name)
    assert device.peak(dtype) == pytest.approx(tflops * 1e12)
    assert device.memory_bytes == mem_gib * GIB
    assert device.mem_bandwidth == pytest.approx(bw_gbps * 1e9)
    assert 0 < device.matmul_efficiency(dtype) <= 1 and 0 < device.memory_efficiency <= 1


def test_device_lookup_is_case_insensitive_and_errors_list_names() -> None:
    assert device_type("a100-sxm4-80gb") is DEVICE_TYPES["A100-SXM4-80GB"]
    with pytest.raises(ValueError, match="unknown device type 'B200'.*H100-SXM"):
        device_type("B200")


def test_peak_of_unknown_dtype_names_known_dtypes() -> None:
    with pytest.raises(ValueError, match=r"'bfloat16'.*\['float16', 'float32'\]"):
        device_type("V100-SXM2-16GB").peak("bfloat16")


def test_device_type_accepts_mapping_and_is_hashable() -> None:
    a = DeviceType("x", {"float32": 1e12, "float16": 2e12}, 1e9, 1e11, 0.5)
    b = DeviceType("x", (("float16", 2e12), ("float32", 1e12)), 1e9, 1e11, 0.5)
    assert a == b and hash(a) == hash(b)
    assert a.peak("float16") == 2e12


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"peak_flops": {"float64": 1e12}}, ValueError, r"unknown dtypes \[.float64.\]"),
        ({"peak_flops": {}}, ValueError, "needs one of"),
        ({"peak_flops": {"float32": -1.0}}, ValueError, "float32"),
        ({"memory_bytes": 0}, ValueError, "memory_bytes"),
        ({"mem_bandwidth": "fast"}, TypeError, "mem_bandwidth"),
        ({"efficiency": 1.5}, ValueError, "efficiency"),
        ({"name": ""}, ValueError, "name"),
    ],
)
def test_device_type_validation(kwargs: dict, error: type[Exception], match: str) -> None:
    fields = {"name": "x", "peak_flops": {"float32": 1e12}, "memory_bytes": 1e9, "mem_bandwidth": 1e11, "efficiency": 0.5}
    with pytest.raises(error, match=match):
        DeviceType(**{**fields, **kwargs})


@pytest.mark.parametrize(
    ("name", "gbytes_per_s", "effective", "latency_us"),
    [
        ("nvlink-v100", 150, 130.5, 5),
        ("nvlink3", 300, 234, 5),  # perf_tables §4: all-reduce bus bandwidth ≈ 235 GB/s
        ("nvlink4", 450, 351, 5),
        ("pcie3", 16, 12, 10),
        ("ib-hdr", 25, 21.25, 10),
        ("dgx-a100-ib", 200, 170, 10),
        ("dgx-h100-ib", 400, 340, 10),
        ("25gbe", 3.125, 2.65625, 50),
        ("loopback", 5, 5, 20),
    ],
)
def test_link_presets(name: str, gbytes_per_s: float, effective: float, latency_us: float) -> None:
    link = link_preset(name)
    assert link.bandwidth == pytest.approx(gbytes_per_s * 1e9)
    assert link.effective_bandwidth == pytest.approx(effective * 1e9)
    assert link.latency == pytest.approx(latency_us * 1e-6)


def test_link_validation_and_unknown_preset() -> None:
    assert Link(1e9, 0).latency == 0.0
    with pytest.raises(ValueError, match="bandwidth"):
        Link(0, 1e-6)
    with pytest.raises(ValueError, match="latency"):
        Link(1e9, -1e-6)
    with pytest.raises(ValueError, match="unknown link 'nvlink9'.*nvlink3"):
        link_preset("nvlink9")


# ---------------------------------------------------------------- Cluster and presets


def test_cluster_counts_and_default_mesh_shape() -> None:
    cluster = preset_cluster("dgx-h100", 4)
    assert cluster.num_devices == 32
    assert cluster.default_mesh_shape() == (4, 8)
    assert cluster.device == device_type("H100-SXM")
    assert cluster.intra_host == link_preset("nvlink4")
    assert cluster.inter_host == link_preset("dgx-h100-ib")


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("num_hosts", 0, ValueError),
        ("num_hosts", 2.0, TypeError),
        ("devices_per_host", True, TypeError),
        ("devices_per_host", -8, ValueError),
        ("name", "", ValueError),
        ("device", "V100-SXM2-16GB", TypeError),
        ("inter_host", (1e9, 1e-6), TypeError),
    ],
)
def test_cluster_validation(field: str, value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=field):
        dataclasses.replace(local_cluster(2), **{field: value})


@pytest.mark.parametrize(
    ("spec", "hosts", "per_host", "device"),
    [
        ("local:4", 1, 4, "cpu"),
        ("local:1x3", 1, 3, "cpu"),
        ("p3.16xlarge:2", 2, 8, "V100-SXM2-16GB"),
        ("p3.16xlarge:1x4", 1, 4, "V100-SXM2-16GB"),
        ("dgx-a100:4", 4, 8, "A100-SXM4-80GB"),
        ("dgx-a100:2x2", 2, 2, "A100-SXM4-80GB"),
        ("DGX-H100:1", 1, 8, "H100-SXM"),
    ],
)
def test_parse_cluster_spec_forms(spec: str, hosts: int, per_host: int, device: str) -> None:
    cluster = parse_cluster_spec(spec)
    assert (cluster.num_hosts, cluster.devices_per_host) == (hosts, per_host)
    assert cluster.device.name == device


def test_local_cluster_uses_loopback() -> None:
    cluster = parse_cluster_spec("local:8")
    assert cluster.intra_host == link_preset("loopback")
    assert cluster == local_cluster(8)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("dgx-a100", "valid forms"),
        ("tpu-v4:2", r"valid presets: \['dgx-a100', 'dgx-h100', 'local', 'p3.16xlarge'\]"),
        ("dgx-a100:two", "bad device count 'two'"),
        ("dgx-a100:0", "bad device count '0'"),
        ("dgx-a100:1x2x3", "HxK"),
        ("dgx-a100:1x9", "8 devices per host, asked for 9"),
        ("local:2x4", "hosts must be 1"),
        ("missing_file.yaml", "missing_file.yaml: cannot read"),
    ],
)
def test_parse_cluster_spec_errors(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_cluster_spec(spec)


def test_parse_cluster_spec_rejects_non_string() -> None:
    with pytest.raises(TypeError, match="string"):
        parse_cluster_spec(8)  # type: ignore[arg-type]


def test_every_preset_parses() -> None:
    for name in CLUSTER_PRESETS:
        assert parse_cluster_spec(f"{name}:1").num_hosts == 1


# ---------------------------------------------------------------- YAML


def test_example_yaml_loads_and_equals_p3_preset_hardware() -> None:
    cluster = parse_cluster_spec(str(EXAMPLE))
    preset = preset_cluster("p3.16xlarge", 2)
    assert cluster.name == "two-v100-hosts"
    assert (cluster.device, cluster.intra_host, cluster.inter_host) == (
        preset.device,
        preset.intra_host,
        preset.inter_host,
    )
    assert load_cluster_yaml(EXAMPLE) == cluster


def _custom_cluster() -> Cluster:
    device = DeviceType("my-gpu", {"float32": 12.5e12, "bfloat16": 100e12}, 24 * GIB, 1.2e12, 0.55)
    return Cluster("custom", 3, 4, device, Link(64e9, 3e-6), Link(12.5e9, 15e-6))


@pytest.mark.parametrize("make", [_custom_cluster, lambda: preset_cluster("dgx-a100", 2), lambda: local_cluster(3)])
def test_yaml_round_trip(make: Callable[[], Cluster], tmp_path: Path) -> None:
    cluster = make()
    path = tmp_path / "c.yaml"
    path.write_text(dump_cluster_yaml(cluster))
    assert load_cluster_yaml(path) == cluster
    assert cluster_from_dict(cluster_to_dict(cluster)) == cluster


def test_presets_serialize_by_name() -> None:
    data = cluster_to_dict(preset_cluster("p3.16xlarge", 2))
    assert (data["device"], data["intra_host"], data["inter_host"]) == ("V100-SXM2-16GB", "nvlink-v100", "25gbe")
    assert isinstance(cluster_to_dict(_custom_cluster())["device"], dict)


def _base_dict() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def _without(key: str) -> dict:
    data = _base_dict()
    del data[key]
    return data


def _with(path: str, value: object) -> dict:
    data = _base_dict()
    *parents, last = path.split(".")
    target = data
    for part in parents:
        target = target[part]
    target[last] = value
    return data


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (_without("hosts"), "missing key 'hosts'"),
        (_without("inter_host"), "missing key 'inter_host'"),
        (_with("device.memory_gb", None), "key 'device.memory_gb': expected a number, got None"),
        (_with("colour", "blue"), "unknown key 'colour'; valid keys"),
        (_with("device.clock_ghz", 1.5), "unknown key 'device.clock_ghz'"),
        (_with("hosts", -2), "key 'hosts': expected an integer > 0, got -2"),
        (_with("hosts", 2.5), "key 'hosts': expected an integer > 0"),
        (_with("devices_per_host", "8"), "key 'devices_per_host': expected an integer > 0, got '8'"),
        (_with("name", 7), "key 'name': expected a non-empty string"),
        (_with("device.mem_bandwidth_gbps", -900), "key 'device.mem_bandwidth_gbps': expected a finite number > 0"),
        (_with("device.efficiency", 1.5), "key 'device'.*efficiency must be in"),
        (_with("device.peak_tflops", {"float64": 1.0}), "key 'device.peak_tflops.float64': expected a dtype"),
        (_with("device.peak_tflops", [15.7]), "key 'device.peak_tflops': expected a mapping"),
        (_with("device.peak_tflops.float16", True), "key 'device.peak_tflops.float16': expected a number"),
        (_with("device", "B200"), "key 'device': expected a device preset"),
        (_with("intra_host", "nvlink9"), "key 'intra_host': expected a link preset"),
        (_with("intra_host.latency_us", -1), "key 'intra_host.latency_us': expected a finite number >= 0"),
        (_with("inter_host.bandwidth_gbps", 0), "key 'inter_host.bandwidth_gbps': expected a finite number > 0"),
        (_with("inter_host", 3.125), "key 'inter_host': expected a mapping"),
        ([1, 2], "key '<top level>': expected a mapping"),
    ],
)
def test_malformed_yaml_errors_name_file_and_key(data: object, match: str, tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=match) as info:
        load_cluster_yaml(path)
    assert str(path) in str(info.value)


def test_yaml_syntax_error_names_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\nhosts: [1, 2\n")
    with pytest.raises(ValueError, match=r"broken.yaml: not valid YAML"):
        parse_cluster_spec(str(path))


def test_latency_zero_is_allowed_in_yaml() -> None:
    cluster = cluster_from_dict(_with("intra_host.latency_us", 0))
    assert cluster.intra_host.latency == 0.0


def test_link_presets_table_has_no_duplicates() -> None:
    # cluster_to_dict writes a link by the first preset equal to it; duplicates would rename links.
    assert len(set(LINKS.values())) == len(LINKS)
