"""The bad-input catalogue (issue 11, item 6): every wrong thing a user can hand the command line
gets one line that says what was wrong and what is valid, exit code 2, no traceback, and is
never silently accepted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshplan.cli import EXIT_USAGE, main

MLP = "mlp:layers=2,hidden=16,batch=8"
LOCAL = ["--cluster", "local:4"]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Bad files of every kind, and one good plan to spoil."""
    d = tmp_path_factory.mktemp("bad")

    def put(name: str, text: str) -> str:
        (d / name).write_text(text)
        return str(d / name)

    good = str(d / "good.json")
    assert main(["plan", MLP, *LOCAL, "--mesh", "1x4", "-o", good, "-q"]) == 0
    doc = json.loads(Path(good).read_text())
    return {
        "good": good,
        "yaml_syntax": put("syntax.yaml", "name: x\nhosts: [1, 2\n"),
        "yaml_list": put("list.yaml", "- 1\n- 2\n"),
        "yaml_no_device": put("nodevice.yaml", "name: c\nhosts: 2\ndevices_per_host: 4\n"
                              "intra_host: nvlink-v100\ninter_host: {bandwidth_gbps: 10, latency_us: 5}\n"),
        "yaml_bad_device": put("baddevice.yaml", "name: c\nhosts: 2\ndevices_per_host: 4\n"
                               "device: Z100\nintra_host: nvlink-v100\n"
                               "inter_host: {bandwidth_gbps: 10, latency_us: 5}\n"),
        "yaml_negative_bw": put("negbw.yaml", "name: c\nhosts: 2\ndevices_per_host: 4\n"
                                "device: V100-SXM2-16GB\nintra_host: nvlink-v100\n"
                                "inter_host: {bandwidth_gbps: -10, latency_us: 5}\n"),
        "yaml_zero_hosts": put("zerohosts.yaml", "name: c\nhosts: 0\ndevices_per_host: 4\n"
                               "device: V100-SXM2-16GB\nintra_host: nvlink-v100\n"
                               "inter_host: {bandwidth_gbps: 10, latency_us: 5}\n"),
        "model_syntax": put("syntax_model.py", "def make(:\n"),
        "model_raises": put("raises_model.py", "def make():\n    raise RuntimeError('boom')\n"),
        "model_returns": put("returns_model.py", "def make():\n    return 3\n"),
        "model_not_callable": put("value_model.py", "make = 3\n"),
        "plan_not_json": put("notjson.json", "{this is not json"),
        "plan_truncated": put("truncated.json", Path(good).read_text()[:200]),
        "plan_list": put("list.json", "[1, 2, 3]\n"),
        "plan_missing": put("missing_field.json",
                            json.dumps({k: v for k, v in doc.items() if k != "mesh_shape"})),
        "plan_bad_mesh": put("bad_mesh.json", json.dumps(doc | {"mesh_shape": [0, 4]})),
        "plan_bad_version": put("bad_version.json", json.dumps(doc | {"version": 999})),
        "not_a_script": put("script.txt", "not python"),
    }


CASES: list[tuple[str, list[str], str]] = [
    # zoo specs
    ("unknown zoo kind", ["plan", "lstm:layers=2", *LOCAL], "unknown"),
    ("unknown zoo field", ["plan", "mlp:depth=3", *LOCAL], "depth"),
    ("non-integer zoo field", ["plan", "mlp:layers=two", *LOCAL], "layers"),
    ("zero layers", ["plan", "mlp:layers=0", *LOCAL], "layers"),
    ("unknown preset", ["plan", "gpt:preset=7x", *LOCAL], "preset"),
    ("heads not dividing hidden", ["plan", "gpt:hidden=30,heads=4", *LOCAL], "heads"),
    ("malformed zoo spec", ["plan", "mlp:layers", *LOCAL], "mlp:layers"),
    ("unknown wresnet depth", ["plan", "wresnet:layers=10", *LOCAL], "valid depths"),
    # cluster specs and files
    ("unknown cluster preset", ["plan", MLP, "--cluster", "tpu:4"], "tpu"),
    ("zero devices", ["plan", MLP, "--cluster", "local:0"], "local:0"),
    ("bad device count", ["plan", MLP, "--cluster", "local:four"], "local:four"),
    ("missing cluster file", ["plan", MLP, "--cluster", "nowhere.yaml"], "nowhere.yaml"),
    ("YAML syntax error", ["plan", MLP, "--cluster", "{yaml_syntax}"], "syntax.yaml"),
    ("YAML not a mapping", ["plan", MLP, "--cluster", "{yaml_list}"], "list.yaml"),
    ("YAML without a device", ["plan", MLP, "--cluster", "{yaml_no_device}"], "device"),
    ("unknown device type", ["plan", MLP, "--cluster", "{yaml_bad_device}"], "Z100"),
    ("negative bandwidth", ["plan", MLP, "--cluster", "{yaml_negative_bw}"], "bandwidth"),
    ("zero hosts", ["plan", MLP, "--cluster", "{yaml_zero_hosts}"], "hosts"),
    # meshes
    ("mesh of the wrong size", ["plan", MLP, *LOCAL, "--mesh", "1x3"], "(1, 3)"),
    ("malformed mesh", ["plan", MLP, *LOCAL, "--mesh", "4"], "mesh"),
    ("zero mesh axis", ["plan", MLP, *LOCAL, "--mesh", "0x4"], "0x4"),
    ("3-D mesh", ["plan", MLP, *LOCAL, "--mesh", "1x2x2"], "1x2x2"),
    # alpha / beta
    ("alpha without beta", ["plan", MLP, *LOCAL, "--alpha", "1,1"], "beta"),
    ("one alpha value", ["plan", MLP, *LOCAL, "--alpha", "1", "--beta", "1,1"], "alpha"),
    ("negative beta", ["plan", MLP, *LOCAL, "--alpha", "1,1", "--beta", "-1,1"], "beta"),
    ("non-numeric alpha", ["plan", MLP, *LOCAL, "--alpha", "a,b", "--beta", "1,1"], "alpha"),
    # budgets and step settings
    ("negative budget", ["plan", MLP, *LOCAL, "--memory-budget-gb", "-1"], "-1"),
    ("NaN budget", ["plan", MLP, *LOCAL, "--memory-budget-gb", "nan"], "nan"),
    ("budget too small", ["plan", MLP, *LOCAL, "--memory-budget-gb", "0.0000001"], "GiB"),
    ("unknown dtype", ["plan", MLP, *LOCAL, "--dtype", "fp8"], "fp8"),
    ("zero micro-batches", ["plan", MLP, *LOCAL, "--microbatches", "0"], "0"),
    ("micro-batches not dividing the batch",
     ["plan", MLP, *LOCAL, "--microbatches", "3"], "3"),
    ("unknown method", ["plan", MLP, *LOCAL, "--method", "fsdp"], "fsdp"),
    ("bad megatron spec", ["plan", MLP, *LOCAL, "--method", "megatron:dp=3,tp=1,pp=1"], "dp"),
    ("unknown optimizer", ["plan", MLP, *LOCAL, "--optimizer", "lamb"], "lamb"),
    ("ratios on a baseline", ["plan", MLP, *LOCAL, "--method", "dp-even", "--ratios", "1,1,1,1"],
     "axis_weights"),
    # model files
    ("missing model file", ["plan", "nowhere.py:make", *LOCAL], "nowhere.py"),
    ("model file syntax error", ["plan", "{model_syntax}:make", *LOCAL], "syntax_model.py"),
    ("model function missing", ["plan", "{model_raises}:build", *LOCAL], "build"),
    ("model function raising", ["plan", "{model_raises}:make", *LOCAL], "boom"),
    ("model function returning junk", ["plan", "{model_returns}:make", *LOCAL], "make"),
    ("model attribute not callable", ["plan", "{model_not_callable}:make", *LOCAL], "make"),
    # plan files
    ("missing plan file", ["simulate", "nowhere.json"], "nowhere.json"),
    ("plan not JSON", ["simulate", "{plan_not_json}"], "notjson.json"),
    ("truncated plan", ["show-program", "{plan_truncated}", "--rank", "0"], "truncated.json"),
    ("plan not an object", ["simulate", "{plan_list}"], "list.json"),
    ("plan missing a field", ["simulate", "{plan_missing}"], "mesh_shape"),
    ("plan with a bad mesh", ["simulate", "{plan_bad_mesh}"], "mesh"),
    ("plan of another format version", ["simulate", "{plan_bad_version}"], "version"),
    ("rank outside the plan", ["show-program", "{good}", "--rank", "4"], "rank"),
    ("negative rank", ["show-program", "{good}", "--rank", "-1"], "rank"),
    # launching
    ("missing training script", ["run", "--nproc", "2", "nowhere.py"], "nowhere.py"),
    ("zero processes", ["run", "--nproc", "0", "{not_a_script}"], "0"),
]


@pytest.mark.parametrize("argv,expected", [(a, e) for _, a, e in CASES],
                         ids=[name for name, _, _ in CASES])
def test_a_bad_input_is_one_clear_line(files: dict[str, str], argv: list[str], expected: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a.format(**files) for a in argv]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == EXIT_USAGE, (code, out, err)
    assert out == "" and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("meshplan: error: ")]
    assert len(lines) == 1, err
    assert expected in lines[0], lines[0]


def test_the_catalogue_is_large() -> None:
    assert len(CASES) >= 40
