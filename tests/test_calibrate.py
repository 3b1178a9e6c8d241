"""`meshplan calibrate` (issue 11, item 5): a profile measured over 4 local gloo processes,
which `--cluster` accepts and whose all-reduce predictions for 1 KiB .. 64 MiB are within 25 %
of the measured medians."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshplan.cli import main
from meshplan.cost.cluster import parse_cluster_spec
from meshplan.cost.collectives import collective_cost
from meshplan.cost.mesh import logical_mesh
from meshplan.runtime.pool import WorkerPool


class _Borrowed:
    """The session's pool as calibrate's ``with WorkerPool(n) as pool``, left open at the end
    (spawning 4 workers and closing them cost ~5 s on 2 cores)."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    def __enter__(self) -> WorkerPool:
        return self.pool

    def __exit__(self, *exc: object) -> None:
        pass


def test_calibrate_writes_a_profile_that_predicts_all_reduce(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], pool4: WorkerPool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import meshplan.runtime.pool

    def borrow(nprocs: int, device: str | None = None) -> _Borrowed:
        assert nprocs == 4 and device == "cpu"   # the session's pool runs on the CPU
        return _Borrowed(pool4)

    monkeypatch.setattr(meshplan.runtime.pool, "WorkerPool", borrow)
    profile = tmp_path / "local.yaml"
    assert main(["calibrate", "--nproc", "4", "-o", str(profile), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    cluster = parse_cluster_spec(str(profile))
    assert cluster.num_devices == 4
    assert cluster.device.matmul_flops("float32") > 0
    mesh = logical_mesh(cluster, (1, 4))
    fit = report["all_reduce"]["4"]
    assert fit["sizes"][0] == 1024 and fit["sizes"][-1] == 64 * 2 ** 20
    for nbytes, measured in zip(fit["sizes"], fit["measured_s"]):
        predicted = collective_cost("all_reduce", mesh, (1,), nbytes)
        assert predicted == pytest.approx(measured, rel=0.25), (nbytes, predicted, measured)
    # Planning on the profile works like on any cluster file.
    assert main(["plan", "mlp:layers=2,hidden=16,batch=8", "--cluster", str(profile), "-q"]) == 0


def test_calibrate_needs_two_processes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["calibrate", "--nproc", "1", "-o", str(tmp_path / "x.yaml")]) == 2
    assert "at least 2" in capsys.readouterr().err


def test_a_slow_dtype_is_measured_on_smaller_products(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 on a CPU without bf16 units took 2.6 s a 1024-square product and 16 s of a
    calibration: products grow from the smallest only while one stays under the bound."""
    import torch

    from meshplan.cost import calibrate
    sizes: list[int] = []
    randn = torch.randn

    def recorded(*shape: int, **kw: object) -> torch.Tensor:
        sizes.append(shape[0])
        return randn(*shape, **kw)

    monkeypatch.setattr(torch, "randn", recorded)
    monkeypatch.setattr(calibrate, "PRODUCT_SECONDS", 0.0)   # every product is too slow
    assert calibrate.matmul_tflops(torch.float32, 1024, 1) > 0
    assert set(sizes) == {calibrate.SMALLEST_PRODUCT}
    sizes.clear()
    monkeypatch.setattr(calibrate, "PRODUCT_SECONDS", 1e9)   # none is
    assert calibrate.matmul_tflops(torch.float32, 512, 1) > 0
    assert sizes[-1] == 512 and sorted(set(sizes)) == [128, 256, 512]
