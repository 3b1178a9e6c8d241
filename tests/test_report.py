"""The plan report (issue 11, item 4), rendered by headless Chromium (Debian's package, which
`make test` installs): every section present for a 2-stage plan and for an 8-stage GPT-39B
(8 of its layers) on 64 GPUs, a non-empty screenshot; and `meshplan diff`."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

import meshplan
from meshplan.cli import main
from meshplan.plan.report import render_report
from meshplan.zoo.spec import build_workload

SECTIONS = ("summary", "cluster", "stages", "sharding", "timeline", "memory", "collectives")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]


def _plan(spec: str, cluster: str, method: str, **kw) -> meshplan.Plan:
    w = build_workload(spec, device="meta")
    return meshplan.plan(w.model, w.loss_fn, "adamw", w.example_batch, cluster, method=method,
                         name=spec, **kw)


@pytest.fixture(scope="module")
def plans() -> dict[str, meshplan.Plan]:
    return {
        "two": _plan("gpt:hidden=64,layers=4,heads=4,seq=16,vocab=128,batch=8", "local:4",
                     "megatron:dp=1,tp=2,pp=2", dtype="fp32"),
        # mb=1 is what the grid of micro-batch sizes chooses here; given, it is not searched.
        # GPT-39B's widths with a layer a stage: the report draws stages and devices, and
        # tracing the other 40 layers took most of this file's time.
        "gpt39b": _plan("gpt:preset=39b,layers=8,batch=1024", "p3.16xlarge:8",
                        "megatron:dp=1,tp=8,pp=8,mb=1", dtype="fp16"),
    }


def _render(page: str, tmp_path: Path, name: str) -> tuple[str, Path]:
    """The DOM Chromium builds from ``page`` and a screenshot of it, from one Chromium run (the
    page has no script, so the window size does not change its DOM)."""
    html = tmp_path / f"{name}.html"
    html.write_text(page)
    shot = tmp_path / f"{name}.png"
    dom = subprocess.run([CHROMIUM, *FLAGS, "--dump-dom", "--window-size=1280,2000",
                          f"--screenshot={shot}", html.as_uri()], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    return dom, shot


@pytest.mark.parametrize("name,stages", [("two", 2), ("gpt39b", 8)])
def test_the_report_renders_every_section(plans, tmp_path: Path, name: str, stages: int) -> None:
    plan = plans[name]
    assert plan.num_stages == stages
    page = render_report(plan)
    bare = page.replace("http://www.w3.org/2000/svg", "")   # SVG's namespace, not a fetch
    assert "http://" not in bare and "https://" not in bare and "<script src" not in bare
    dom, shot = _render(page, tmp_path, name)
    for section in SECTIONS:
        assert re.search(rf'<section id="{section}">', dom), section
    drawn = re.findall(r"<title>device (\d+) \(", dom)
    assert sorted(map(int, drawn)) == sorted(d for s in plan.stages for d in s.devices)
    assert dom.count("stage ") >= stages and "limit" in dom
    assert len(re.findall(r"<title>(forward|backward) stage", dom)) >= 2 * stages
    assert shot.stat().st_size > 20_000          # a page with pictures, not a blank one


def test_report_and_diff_on_the_command_line(plans, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    plans["two"].save(str(a))
    w = build_workload(plans["two"].model, device="meta")
    meshplan.plan(w.model, w.loss_fn, "adamw", w.example_batch, "local:4", mesh_shape=(1, 4),
                  method="data", dtype="fp32", name=plans["two"].model,
                  microbatches=plans["two"].microbatches).save(str(b))
    assert main(["report", str(a), "-o", str(tmp_path / "a.html")]) == 0
    assert "<section id='timeline'>" in (tmp_path / "a.html").read_text()
    capsys.readouterr()
    assert main(["diff", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"stages\s+2\s+1\s+\*", out), out
    assert re.search(r"method\s+megatron:dp=1,tp=2,pp=2\s+data", out), out
    assert "takes" in out and "bytes moved per step" in out
    assert main(["report", str(tmp_path / "missing.json"), "-o", "x.html"]) == 2
