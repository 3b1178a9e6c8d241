"""Launch where users run (issue 11, item 1): the same training script (examples/train.py, the
user's own loop through ``meshplan.parallelize``) trains a 2-stage plan under ``meshplan run``
under ``torchrun`` with two "nodes" on loopback (c10d rendezvous) and on a local Ray cluster
(an actor per rank), with the losses of one device; a failing process stops the run at once."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import meshplan
from meshplan.runtime.launch_env import find_free_port
from meshplan.zoo.spec import build_workload

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "examples" / "train.py")
SLOW_RECEIVER = str(ROOT / "tests" / "slow_receiver.py")
SPEC = "gpt:hidden=32,layers=4,heads=4,seq=8,vocab=64,batch=8"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                   os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    w = build_workload(SPEC, device="meta")
    plan = meshplan.plan(w.model, w.loss_fn, "adamw", w.example_batch, "local:2",
                         method="megatron:dp=1,tp=1,pp=2", dtype="fp32", name=SPEC)
    assert plan.num_stages == 2
    path = str(tmp_path_factory.mktemp("launch") / "plan.json")
    plan.save(path)
    return path


def _one_device(steps: int = 3) -> list[float]:
    """examples/train.py's loop on one device."""
    w = build_workload(SPEC, device="cpu", seed=0)
    model = copy.deepcopy(w.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        (x,), t = build_workload(SPEC, device="cpu", seed=1 + step).example_batch
        torch.manual_seed(step)
        loss = w.loss_fn(model(x), t)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_meshplan_run_torchrun_and_ray_train_like_one_device(plan_file: str, tmp_path: Path
                                                          ) -> None:
    # The three launches at once: the imports and Ray's start, not the training, take their
    # time. Local processes, torchrun's two nodes, and a local Ray cluster (an actor a rank).
    # The local run's rank 0 is late to receive the tied gradients' parts (SLOW_RECEIVER):
    # rank 1, done first, exits only once its part is delivered (it hung before).
    ran, torchrun, port = tmp_path / "run.json", tmp_path / "torchrun.json", find_free_port()
    on_ray = tmp_path / "ray.json"
    procs = [subprocess.Popen([sys.executable, "-m", "meshplan", "run", *ray, "--nproc", "2",
                               *script, plan_file, "--losses", str(out)], env=ENV, cwd=tmp_path)
             for ray, script, out in (([], [SLOW_RECEIVER, SCRIPT], ran),
                                      (["--ray"], [SCRIPT], on_ray))]
    procs += [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
         str(r), "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
         f"127.0.0.1:{port}", "--rdzv-id", "meshplan-test", SCRIPT, plan_file, "--losses",
         str(torchrun)],
        env=ENV, cwd=tmp_path) for r in range(2)]
    try:
        assert [p.wait(timeout=300) for p in procs] == [0, 0, 0, 0]
    finally:
        for p in procs:
            p.kill()
    reference = _one_device()
    for out in (ran, torchrun, on_ray):
        got = list(json.loads(out.read_text()).values())
        assert got == pytest.approx(reference, rel=1e-5), out.name


def test_a_killed_run_resumes_from_its_last_checkpoint(plan_file: str, tmp_path: Path) -> None:
    # Killed (SIGKILL, the whole process group) once it has checkpointed step 2 of 6;
    # started again, it resumes from its latest checkpoint and every later step's loss is
    # the uninterrupted run's.
    ck, steps = tmp_path / "ck", 6
    run = subprocess.Popen([sys.executable, "-m", "meshplan", "run", "--nproc", "2", SCRIPT,
                            plan_file, "--steps", str(steps), "--checkpoint", str(ck)],
                           env=ENV, cwd=tmp_path, start_new_session=True)
    deadline = time.monotonic() + 240
    while not (ck / "latest").exists() or int((ck / "latest").read_text()) < 2:
        assert run.poll() is None and time.monotonic() < deadline, "no checkpoint came"
        time.sleep(0.05)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    resumed_at = int((ck / "latest").read_text())
    assert resumed_at < steps
    out = tmp_path / "resumed.json"
    subprocess.run([sys.executable, "-m", "meshplan", "run", "--nproc", "2", SCRIPT, plan_file,
                    "--steps", str(steps), "--checkpoint", str(ck), "--losses", str(out)],
                   env=ENV, cwd=tmp_path, check=True, timeout=300)
    got = {int(k): v for k, v in json.loads(out.read_text()).items()}
    assert sorted(got) == list(range(resumed_at, steps))
    reference = _one_device(steps)
    assert [got[k] for k in sorted(got)] == pytest.approx(reference[resumed_at:], rel=1e-5)


def test_a_plan_for_another_world_is_one_line(plan_file: str, tmp_path: Path) -> None:
    # One process for the 2-process plan (three took 9 s on the 2-core machine, each starting
    # torch only to be refused): the same refusal.
    done = subprocess.run([sys.executable, "-m", "meshplan", "run", "--nproc", "1", SCRIPT,
                           plan_file], env=ENV, capture_output=True, text=True, timeout=200,
                          cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "train.py: error: the plan runs on 2 processes, this world has 1: launch it " \
           "with --nproc 2" in done.stderr


def test_a_failing_process_stops_the_run(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['RANK'] == '1':\n    sys.exit(3)\n"
                      "time.sleep(120)\n")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "meshplan", "run", "--nproc", "3", str(script)],
                          env=ENV, capture_output=True, text=True, timeout=100)
    assert done.returncode == 1 and time.monotonic() - start < 60
    assert "rank 1 exited with code 3" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_the_launcher_starts_its_ranks_without_torch(tmp_path: Path) -> None:
    """`meshplan run`'s own process parses, finds a port and starts the ranks without importing
    torch or the planner (4 s of imports here, on the ranks' way), each rank its world's
    variables and the device asked for."""
    script = tmp_path / "env.py"
    script.write_text("import json, os, sys\n"
                      "keys = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_PORT', "
                      "'MESHPLAN_DEVICE')\n"
                      "json.dump({k: os.environ[k] for k in keys}, "
                      "open(sys.argv[1] + os.environ['RANK'], 'w'))\n")
    code = ("import sys; from meshplan.cli import main; "
            f"code = main(['run', '--nproc', '2', '--device', 'cpu', {str(script)!r}, "
            f"{str(tmp_path / 'rank')!r}]); "
            "print(code, sorted(m for m in ('torch', 'numpy', 'meshplan.api') "
            "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.strip() == "0 []", done.stdout + done.stderr
    seen = [json.loads((tmp_path / f"rank{r}").read_text()) for r in range(2)]
    assert [s["RANK"] for s in seen] == ["0", "1"] and {s["WORLD_SIZE"] for s in seen} == {"2"}
    assert seen[0]["MASTER_PORT"] == seen[1]["MASTER_PORT"]
    assert {s["MESHPLAN_DEVICE"] for s in seen} == {"cpu"}


def test_a_failing_ray_rank_stops_the_run(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import os\nif os.environ['RANK'] == '1':\n"
                      "    raise RuntimeError('rank one gave up')\n"
                      "import time\ntime.sleep(120)\n")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "meshplan", "run", "--ray", "--nproc", "2",
                           str(script)], env=ENV, capture_output=True, text=True, timeout=200)
    assert done.returncode == 1 and time.monotonic() - start < 90
    assert "meshplan: error: rank 1 failed: RuntimeError: rank one gave up" in done.stderr, \
        done.stderr[-2000:]


def test_run_refuses_what_it_cannot_start(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    # In-process (`main` returns the exit code `python -m meshplan` exits with): the refusal
    # comes before any process starts, and a subprocess only added an interpreter's start.
    from meshplan.cli import main
    assert main(["run", "--nproc", "2", str(tmp_path / "missing.py")]) == 2
    err = capsys.readouterr().err
    assert err.strip().endswith("give the path of a Python file"), err
