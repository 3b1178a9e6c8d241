"""Clusters of mixed device types (issue 10, typed devices): the YAML host groups, each
device's type, and the one type a plan of even shards runs as (the bottleneck)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import meshplan.api as api
from meshplan.cost.cluster import (Cluster, cluster_from_dict, cluster_to_dict, load_cluster_yaml,
                                   mixed_cluster, parse_cluster_spec)
from meshplan.cost.devices import GIB, bottleneck_device, device_type, link_preset
from meshplan.zoo.spec import build_workload

ROOT = Path(__file__).resolve().parents[1]
V100, P100, A100 = (device_type(n) for n in ("V100-SXM2-16GB", "P100-SXM2-16GB",
                                             "A100-SXM4-80GB"))
HAP = ROOT / "examples" / "clusters" / "hap_v100_p100.yaml"


def _groups(hosts: list) -> dict:
    return {"name": "mix", "hosts": hosts, "devices_per_host": 2, "intra_host": "pcie3",
            "inter_host": "25gbe"}


def test_haps_cluster_loads_with_each_devices_type() -> None:
    c = parse_cluster_spec(str(HAP))
    assert (c.num_hosts, c.devices_per_host, c.num_devices) == (8, 8, 64)
    assert c.is_mixed and c.types == (V100,) * 16 + (P100,) * 48
    assert c.inter_host.bandwidth == pytest.approx(1.3e9)
    # Even shards run at the P100's pace and fit its memory.
    assert c.device.matmul_flops("float32") == pytest.approx(P100.matmul_flops("float32"))
    assert c.device.memory_bytes == 16 * GIB


def test_the_bottleneck_takes_each_figure_from_the_slowest_type() -> None:
    small_fast = V100                     # 16 GiB, 125 TF fp16
    big_slow = A100.__class__("big-slow", {"float32": 5e12, "float16": 50e12}, 80 * GIB,
                              2e12, 0.5, 0.5)
    b = bottleneck_device([small_fast, big_slow, small_fast])
    assert b.memory_bytes == 16 * GIB                                  # the V100's
    assert b.matmul_flops("float32") == pytest.approx(2.5e12)          # big-slow's 5e12 x 0.5
    assert b.matmul_flops("float16") == pytest.approx(min(V100.matmul_flops("float16"), 25e12))
    assert b.effective_mem_bandwidth == pytest.approx(min(V100.effective_mem_bandwidth, 1e12))
    assert bottleneck_device([V100, V100]) is V100
    # The A100 knows bfloat16, the V100 not: the bottleneck has no bfloat16.
    assert [d for d, _ in bottleneck_device([V100, A100]).peak_flops] == ["float16", "float32"]
    with pytest.raises(ValueError, match="at least one"):
        bottleneck_device([])


def test_hosts_may_mix_types_and_groups_round_trip(tmp_path: Path) -> None:
    data = _groups([{"count": 2, "device": "V100-SXM2-16GB"},
                    {"count": 1, "device": ["V100-SXM2-16GB", "P100-SXM2-16GB"]},
                    {"count": 1, "device": "P100-SXM2-16GB"}])
    c = cluster_from_dict(data)
    assert c.types == (V100, V100, V100, V100, V100, P100, P100, P100)
    again = cluster_to_dict(c)
    assert again["hosts"] == data["hosts"] and "device" not in again
    path = tmp_path / "mix.yaml"
    path.write_text(yaml.safe_dump(again))
    assert load_cluster_yaml(path) == c
    # One type in every group is no mix: the plain form comes back.
    same = cluster_from_dict(_groups([{"count": 3, "device": "V100-SXM2-16GB"}]))
    assert not same.is_mixed and same.device == V100 and cluster_to_dict(same)["hosts"] == 3


@pytest.mark.parametrize("hosts,match", [
    ([], "key 'hosts': expected a host count or a non-empty list"),
    ([{"count": 0, "device": "V100-SXM2-16GB"}], "key 'hosts\\[0\\].count': expected an integer"),
    ([{"count": 1}], "missing key 'hosts\\[0\\].device'"),
    ([{"count": 1, "device": "V100-SXM2-16GB", "links": 2}], "unknown key 'hosts\\[0\\].links'"),
    ([{"count": 1, "device": ["V100-SXM2-16GB"]}], "one type per device: a list of 2"),
    ([{"count": 1, "device": ["V100-SXM2-16GB", "B200"]}],
     "key 'hosts\\[0\\].device\\[1\\]': expected a device preset"),
])
def test_bad_host_groups_say_what_is_wrong(hosts: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cluster_from_dict(_groups(hosts), "mix.yaml")


def test_a_groups_cluster_takes_no_top_level_device() -> None:
    data = _groups([{"count": 1, "device": "V100-SXM2-16GB"}]) | {"device": "V100-SXM2-16GB"}
    with pytest.raises(ValueError, match="unknown key 'device'"):
        cluster_from_dict(data)


def test_a_mixed_cluster_checks_its_fields() -> None:
    link = link_preset("pcie3")
    c = mixed_cluster("m", [(V100, P100)], link, link)
    with pytest.raises(ValueError, match="lists 3 devices"):
        Cluster("m", 1, 2, c.device, link, link, (V100, P100, P100))
    with pytest.raises(ValueError, match="bottleneck_device"):
        Cluster("m", 1, 2, V100, link, link, (V100, P100))
    with pytest.raises(ValueError, match="same number of devices"):
        mixed_cluster("m", [(V100, P100), (V100,)], link, link)


def test_a_plan_on_a_mixed_cluster_is_priced_on_its_slowest_device() -> None:
    """Until the heterogeneous planner (issue 10) gives fast devices larger shares, a plan of
    even shards on a mixed cluster costs what it costs on the slowest type alone."""
    w = build_workload("mlp:layers=2,hidden=512,batch=256", device="meta")
    link = link_preset("pcie3")
    mixed = mixed_cluster("mix", [(V100, V100), (P100, P100)], link, link)
    slow = mixed_cluster("slow", [(P100, P100), (P100, P100)], link, link)
    fast = mixed_cluster("fast", [(V100, V100), (V100, V100)], link, link)
    step = {c.name: api.plan(w.model, w.loss_fn, "sgd", w.example_batch, c, method="data",
                             mesh_shape=(2, 2)).predicted["step_time_s"]
            for c in (mixed, slow, fast)}
    assert step["mix"] == pytest.approx(step["slow"]) and step["mix"] > step["fast"]


def test_the_pipeline_search_and_the_simulator_take_a_mixed_cluster(tmp_path: Path) -> None:
    """Stages are priced on parts of the cluster (of its bottleneck type), and the plan's
    cluster, written with its host groups, is read back by the simulator."""
    from meshplan.plan.plan import plan_from_json
    from meshplan.sim.simulate import simulate
    w = build_workload("gpt:hidden=256,layers=2,heads=4,seq=64,vocab=512,batch=16",
                       device="meta")
    link = link_preset("pcie3")
    mixed = mixed_cluster("mix", [(V100, V100), (P100, P100)], link, link_preset("25gbe"))
    p = api.plan(w.model, w.loss_fn, "adamw", w.example_batch, mixed, num_layers=2,
                 microbatches=2, memory_budget_gb=0, dtype="fp32")
    assert p.cluster["hosts"] == [{"count": 1, "device": "V100-SXM2-16GB"},
                                  {"count": 1, "device": "P100-SXM2-16GB"}]
    back = plan_from_json(p.to_json())
    assert simulate(back).step_time_s == pytest.approx(simulate(p).step_time_s)
