# Both targets create or refresh .venv, so they work on a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-pipeline test bench coverage clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m meshplan.demo

demo-pipeline: $(STAMP)
	$(BIN)/python -m meshplan.demo_pipeline --nproc 4

test: $(STAMP)
	$(BIN)/python -m pytest tests

coverage: $(STAMP)
	$(BIN)/python benchmarks/coverage.py --workers 2

bench: $(STAMP)
	$(BIN)/python benchmarks/plan_speed.py

clean:
	rm -rf $(VENV) *.egg-info
