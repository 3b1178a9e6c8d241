"""The ``meshplan`` command line: in-process ``main([...])`` runs, plus one ``python -m`` run."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from meshplan.cli import EXIT_USAGE, main
from meshplan.plan.plan import load_plan

SMALL = "mlp:layers=2,hidden=64,batch=32"
M1 = ["mlp:layers=6,hidden=32,batch=256,bias=1", "--cluster", "local:4", "--mesh", "1x4",
      "--alpha", "1,1", "--beta", "1,1", "--memory-budget-gb", "0"]
REPO = Path(__file__).resolve().parents[1]

USER_FILE = """
import torch
from torch import nn

def make():
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    batch = ((torch.randn(8, 16),), torch.randn(8, 4))
    return model, nn.functional.mse_loss, batch
"""


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run a command that must fail as a user error; return its one error message."""
    code, out, err = run(capsys, *argv)
    assert code == EXIT_USAGE == 2
    assert out == ""
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("meshplan: error: ")]
    assert len(lines) == 1, err
    return lines[0].removeprefix("meshplan: error: ")


def test_m1_json_objective_and_single_update_all_reduce(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, *M1, "--json")
    assert code == 0
    doc = json.loads(out)  # the whole of stdout is one JSON document
    assert doc["objective"] == pytest.approx(38028, abs=0.5)
    assert doc["objective_units"] == "alpha-beta units"
    assert doc["mesh_shape"] == [1, 4]
    assert [(c["kind"], c["phase"], c["count"]) for c in doc["collectives"]] == [
        ("all_reduce", "update", 1)]


def test_text_output_is_explain_and_o_saves_the_same_plan(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    code, out, err = run(capsys, *M1, "-o", str(path))
    assert code == 0
    saved = load_plan(path)
    assert out == saved.explain() + "\n"
    assert saved.objective == pytest.approx(38028, abs=0.5)
    assert str(path) in err


def test_json_params_map_and_options_reach_the_planner(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, SMALL, "--cluster", "local:4", "--mesh", "2x2", "--method", "zero2",
                       "--optimizer", "sgd", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["mesh_shape"] == [2, 2]
    assert doc["method"] == "zero2"
    assert doc["optimizer"]["kind"] == "sgd"
    weight = doc["params"]["layers.0.weight"]
    assert {"spec", "storage", "update"} <= weight.keys()
    assert weight["update"] == "zero2"


def test_memory_budget_default_is_device_memory(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, SMALL, "--cluster", "p3.16xlarge:1x4", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["options"]["memory_budget_bytes"] == 16 * 2**30
    assert doc["objective_units"] == "seconds"


def test_model_from_user_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    model_file = tmp_path / "user_model.py"
    model_file.write_text(USER_FILE)
    code, out, _ = run(capsys, f"{model_file}:make", "--cluster", "local:2", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["model"] == f"{model_file}:make"
    assert set(doc["params"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}


@pytest.mark.parametrize(("argv", "needles"), [
    (["foo:layers=2", "--cluster", "local:4"], ["unknown model kind 'foo'", "mlp:", "gpt:"]),
    (["mlp:depth=2", "--cluster", "local:4"], ["unknown field 'depth'", "hidden"]),
    ([SMALL, "--cluster", "tpu:4"], ["bad cluster spec 'tpu:4'", "valid presets", "dgx-a100"]),
    ([SMALL, "--cluster", "local:4", "--mesh", "3x3"], ["has 9 devices", "has 4", "(2, 2)"]),
    ([SMALL, "--cluster", "local:4", "--alpha", "1"], ["--alpha", "two comma-separated", "'1'"]),
    ([SMALL, "--cluster", "local:4", "--alpha", "1,1"], ["both --alpha and --beta"]),
    ([SMALL, "--cluster", "local:4", "--force-batch-dim", "2"],
     ["--force-batch-dim", "0 or 1", "'2'"]),
    ([SMALL, "--cluster", "local:4", "--method", "fsdp"], ["--method", "'fsdp'", "zero3"]),
    ([SMALL, "--cluster", "local:4", "--memory-budget-gb", "-1"], ["--memory-budget-gb", "'-1'"]),
    ([SMALL], ["--cluster"]),
])
def test_bad_arguments_exit_2_with_a_clear_message(
        capsys: pytest.CaptureFixture[str], argv: list[str], needles: list[str]) -> None:
    message = run_error(capsys, *argv)
    for needle in needles:
        assert needle in message


def test_malformed_cluster_yaml(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: x\nhosts: [1, 2\n")
    message = run_error(capsys, SMALL, "--cluster", str(broken))
    assert str(broken) in message and "not valid YAML" in message
    missing_key = tmp_path / "missing.yaml"
    missing_key.write_text("name: x\nhosts: 1\n")
    assert str(missing_key) in run_error(capsys, SMALL, "--cluster", str(missing_key))


def test_model_file_missing_or_without_the_function(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    absent = tmp_path / "absent.py"
    message = run_error(capsys, f"{absent}:make", "--cluster", "local:4")
    assert "does not exist" in message and str(absent) in message
    model_file = tmp_path / "user_model.py"
    model_file.write_text(USER_FILE)
    message = run_error(capsys, f"{model_file}:build", "--cluster", "local:4")
    assert "no function 'build'" in message and "make" in message


def test_budget_no_plan_meets_states_the_minimum(capsys: pytest.CaptureFixture[str]) -> None:
    message = run_error(capsys, SMALL, "--cluster", "local:4", "--memory-budget-gb", "0.000001")
    match = re.search(r"smallest plan needs [\d.]+ GiB per device \((\d+) bytes\)", message)
    assert match is not None, message
    assert int(match.group(1)) > 0.000001 * 2**30


def test_unwritable_output_is_a_user_error(capsys: pytest.CaptureFixture[str],
                                           tmp_path: Path) -> None:
    target = tmp_path / "no_such_dir" / "plan.json"
    message = run_error(capsys, *M1, "-o", str(target))
    assert "cannot write plan" in message and str(target) in message


def test_help_returns_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--help"]) == 0
    assert "--cluster" in capsys.readouterr().out


def test_python_dash_m_prints_one_json_document() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "meshplan", "plan", SMALL, "--cluster", "local:4", "--json"],
        capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert {"objective", "search_time_s", "params", "collectives", "predicted", "ilp"} <= doc.keys()
    assert {"spec", "storage", "update"} <= doc["params"]["layers.0.weight"].keys()


class _Terminal:
    """A stderr that says it is a terminal and keeps what is written to it."""

    def __init__(self) -> None:
        self.text = ""

    def isatty(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self.text += s
        return len(s)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("quiet", [False, True])
def test_progress_bar_on_a_terminal_unless_quiet(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str],
                                                 quiet: bool) -> None:
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    argv = ["plan", "gpt:hidden=32,layers=2,heads=2,seq=8,vocab=32,batch=4",
            "--cluster", "p3.16xlarge:1x2", "--microbatches", "2"] + (["--quiet"] if quiet else [])
    assert main(argv) == 0
    assert ("stage costs, 2 micro-batches" in term.text) is not quiet


def test_no_progress_bar_when_stderr_is_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "gpt:hidden=32,layers=2,heads=2,seq=8,vocab=32,batch=4",
                       "--cluster", "p3.16xlarge:1x2", "--microbatches", "2")
    assert code == 0 and "stage costs" not in err


HAP = "examples/clusters/hap_v100_p100.yaml"
SMALL_BERT = "bert:hidden=64,layers=2,heads=4,seq=16,vocab=128,batch=128"


def test_hetero_plan_shows_each_device_types_share(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, SMALL_BERT, "--cluster", HAP, "--method", "hetero", "--dtype",
                       "fp32", "-q")
    assert code == 0
    assert "on a 1x64 mesh" in out and "method hetero" in out
    assert "program synthesis (A*)" in out
    ratios = re.search(r"V100-SXM2-16GB x16: ([0-9.]+), P100-SXM2-16GB x48: ([0-9.]+)", out)
    assert ratios and float(ratios.group(1)) > float(ratios.group(2)), out


def test_hetero_json_carries_the_ratios_and_gather_choice(capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    code, out, _ = run(capsys, "mlp", "--cluster", "local:4", "--method", "hetero",
                       "--ratios", "4,3,2,1", "--gather", "broadcast", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["axis_weights"][1] == pytest.approx([0.4, 0.3, 0.2, 0.1])
    assert doc["options"]["gather_impl"] == "broadcast"
    assert doc["options"]["hetero"]["ratios"] == pytest.approx([0.4, 0.3, 0.2, 0.1])


def test_sfb_updates_show_in_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "mlp", "--cluster", "local:4", "--method", "hetero",
                       "--ratios", "4,3,2,1", "--sfb", "force")
    assert code == 0
    assert re.search(r"layers\.0\.weight\s+R,R\s+R,R\s+sfb\s+\(1,\)", out), out
    message = run_error(capsys, "mlp", "--cluster", "local:4", "--method", "dp-even", "--sfb",
                        "auto")
    assert "DDP" in message, message


@pytest.mark.parametrize(("argv", "expected"), [
    (("--ratios", "1,x"), "bad ratios '1,x'"),
    (("--ratios", "1,2"), "one non-negative ratio per device of the (1, 4) mesh"),
    (("--gather", "ring"), "invalid choice: 'ring'"),
    (("--sfb", "sometimes"), "invalid choice: 'sometimes'"),
    (("--mesh", "2x2"), "give no mesh_shape"),
])
def test_bad_hetero_arguments_are_one_line_errors(capsys: pytest.CaptureFixture[str],
                                                  argv: tuple[str, ...], expected: str) -> None:
    message = run_error(capsys, "mlp", "--cluster", "local:4", "--method", "hetero", *argv)
    assert expected in message, message
