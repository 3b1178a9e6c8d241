"""The benchmarks' plan children (`benchmarks/plan_quality.run_child`): each script runs as
``python -c`` would run it, in a process of its own forked from a server that imported the
planner once, with the caller's environment; a child past its time is ended with everything
it started, and a crash comes back as a record saying why."""

from __future__ import annotations

import os
import time

import pytest

from bench_modules import load

pq = load("weak_scaling").pq   # as the suite imports it (benchmarks/ on the path)

SCRIPT = """
import json, os, sys
print("some output first")
print(json.dumps({"argv": sys.argv[1:], "env": os.environ.get("MESHPLAN_TEST_VALUE"),
                  "main": __name__, "pid": os.getpid(), "session": os.getsid(0)}))
"""


def test_a_child_runs_its_script_as_python_c_would(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHPLAN_TEST_VALUE", "set after the server started")
    record = pq.run_child([SCRIPT, "gpt-350m", "p3.16xlarge:1x1"], 120)
    assert record["argv"] == ["gpt-350m", "p3.16xlarge:1x1"]
    assert record["env"] == "set after the server started"
    assert record["main"] == "__main__"
    assert record["session"] == record["pid"] != os.getpid()   # its own session
    assert record["wall_s"] > 0


def test_a_child_past_its_time_is_ended_with_what_it_started(tmp_path) -> None:   # noqa: ANN001
    script = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(60)
"""
    began = time.monotonic()
    record = pq.run_child([script, str(tmp_path / "pid")], 8)
    assert record["status"] == "timeout" and time.monotonic() - began < 30
    started = int((tmp_path / "pid").read_text())
    assert _ended(started)


def _ended(pid: int) -> bool:
    """Whether process ``pid`` is gone or a zombie (ended, its parent gone before reaping it),
    within a few seconds."""
    end = time.monotonic() + 5
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def test_a_crash_comes_back_as_a_record_saying_why() -> None:
    record = pq.run_child(["raise RuntimeError('no such row')"], 120)
    assert record["status"] == "error" and "no such row" in record["error"]
