# Both targets create or refresh .venv, so they work on a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-pipeline test bench coverage gpu-check clean

# constraints.txt pins the versions the tests run on; the package declares ranges.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m meshplan.demo

demo-pipeline: $(STAMP)
	$(BIN)/python -m meshplan.demo_pipeline --nproc 4

# The plan report's tests render it in headless Chromium (Debian's package; CI runs as root).
CHROMIUM := /usr/bin/chromium
$(CHROMIUM):
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium > /dev/null

test: $(STAMP) $(CHROMIUM)
	$(BIN)/python -m pytest tests

# meshplan on a real GPU (meshplan/gpu_check.py; docs/gpu.md). It runs on the machine's own
# Python and torch, no venv: a GPU machine brings its own CUDA build (torch>=2.11).
GPU_PY ?= python3
gpu-check:
	$(GPU_PY) -m meshplan.gpu_check

coverage: $(STAMP)
	$(BIN)/python benchmarks/coverage.py --workers 2

bench: $(STAMP)
	$(BIN)/python benchmarks/plan_speed.py

clean:
	rm -rf $(VENV) *.egg-info
