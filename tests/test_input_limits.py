"""Every input answers fast (issue 25.6): absurd model sizes are refused in one line before
anything is built, and a Megatron configuration the model cannot be cut by names the real
constraint."""

from __future__ import annotations

import time

import pytest

import meshplan.api as api
from meshplan.cli import main
from meshplan.zoo.catalog import UPPER
from meshplan.zoo.spec import build_workload, parse_model_spec


@pytest.mark.parametrize("spec,field", [("gpt:layers=1000000000", "layers"),
                                        ("gpt:hidden=1000000000000", "hidden"),
                                        ("moe:experts=100000000", "experts"),
                                        ("wresnet:image=10000000", "image")])
def test_absurd_sizes_are_refused_at_once(spec: str, field: str, capsys) -> None:
    start = time.perf_counter()
    assert main(["plan", spec, "--cluster", "local:4"]) == 2
    err = capsys.readouterr().err
    assert f"field '{field}' must be at most {UPPER[field]:,}" in err
    assert len(err.strip().splitlines()) == 1
    assert time.perf_counter() - start < 5


def test_the_largest_sizes_allowed_still_parse() -> None:
    spec = parse_model_spec(f"gpt:layers={UPPER['layers']},hidden={UPPER['hidden']},heads=16")
    assert spec.get("layers") == UPPER["layers"]


def test_an_interleaved_cut_names_the_chunks() -> None:
    """pp=2 with virtual=2 cuts 4 chunks: a model of 2 blocks is refused for that, not for a
    'pp=4' nobody asked for."""
    w = build_workload("gpt:hidden=32,layers=2,heads=4,seq=8,vocab=64,batch=8", device="meta")
    with pytest.raises(ValueError, match=r"pp=2 with virtual=2 \(4 chunks of layers, pp x "
                                         r"virtual\) does not divide the model's 2 repeated "
                                         r"blocks.*valid pp x virtual: \[1, 2\]"):
        api.plan(w.model, w.loss_fn, "sgd", w.example_batch, "local:2",
                 method="megatron:dp=1,tp=1,pp=2,mb=2,virtual=2", memory_budget_gb=0)
