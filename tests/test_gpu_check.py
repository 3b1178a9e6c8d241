"""``make gpu-check``'s script on the CPU (``--device cpu``): the same checks a GPU machine runs,
so the script works the day one is lent — every plan family equal to one device in fp32 and
bf16 on four emulated ranks, the one-device prediction measured, and ``meshplan run --nproc 1``
end to end with a checkpoint resumed."""

from __future__ import annotations

from meshplan import gpu_check


def test_the_gpu_check_passes_on_the_cpu(tmp_path, capsys) -> None:
    out = tmp_path / "gpu.md"
    prof = tmp_path / "prof"
    assert gpu_check.main(["--device", "cpu", "--out", str(out), "--profile-dir", str(prof)]) == 0
    # (b)'s profiled steps written whole, meshplan's and the plain loop's.
    assert sorted(p.name for p in prof.iterdir()) == ["meshplan.json.gz", "meshplan.txt",
                                                      "plain.json.gz", "plain.txt"]
    text = out.read_text()
    printed = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.startswith("| a ")]
    # Every case of (a) in both dtypes, each passing.
    assert len(rows) == 2 * len(gpu_check.CASES)
    assert all("| pass |" in r for r in rows), rows
    for name in gpu_check.CASES:
        assert f"{name}, fp32" in text and f"{name}, bf16" in text
    assert "| b |" in text and "measured" in text and "| info |" in text
    assert "| b | calibrated | info |" in text and "simulated on them" in text
    assert "| b | plain PyTorch | info |" in text and "meshplan's step x" in text
    assert "| b | profile | info | one step profiled: ops " in text and "matmul" in text
    assert "| c | meshplan run --nproc 1 (gloo) | pass |" in text
    assert "those of one device" in text
    assert "torch 2." in text and "device: CPU" in text
    assert "(a) pass" in printed and "(c) pass" in printed


def test_a_wrong_step_fails_the_check() -> None:
    """The comparison itself: a parameter off by more than the bound is a failure, named."""
    import torch
    ref = ([1.0, 0.9], {"w": torch.ones(3)})
    init = {"w": torch.zeros(3)}
    assert gpu_check._compare("fp32", ref, ref, init) is None
    assert "w differs" in gpu_check._compare("fp32", ([1.0, 0.9], {"w": torch.ones(3) * 1.001}),
                                             ref, init)
    assert "loss differs" in gpu_check._compare("bf16", ([1.1, 0.9], ref[1]), ref, init)
    assert gpu_check._compare("bf16", ([1.0, 0.9], {"w": torch.ones(3) * 1.01}), ref,
                              init) is None   # 0.017 < 32u = 0.125 of the update
