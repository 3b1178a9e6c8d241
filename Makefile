# Both targets create or refresh .venv, so they work on a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-pipeline test bench coverage gpu-check clean

# constraints.txt pins the versions the tests run on; the package declares ranges.
# pip would compile every installed module on one core (26 s of the install here). compileall
# compiles on both cores what every process imports (torch, numpy, scipy and sympy: 12 s, 28 s
# for all); the tests compile the rest as they import it (`test`). compileall skips the files
# this Python cannot compile (torch ships a Python 3.12-only test helper), which makes its
# status 1: not a failure.
#
# uv installs the same pinned set as pip in a quarter of the time (9 s against 35 s here, the
# wheels unpacked on both cores). It does not read pip's configuration, so the indexes and
# wheel folders pip is configured with are handed to it, every index weighed alike as pip
# does; where uv cannot be had or fails, pip installs the set.
SITE = $(VENV)/lib/python3*/site-packages
PIP_GET = $(PY) -m pip config get global.$(1) 2>/dev/null
UV_SOURCES = --index-strategy unsafe-best-match \
	$(foreach u,$(shell $(call PIP_GET,index-url)),--index-url $(u)) \
	$(foreach u,$(shell $(call PIP_GET,extra-index-url)),--extra-index-url $(u)) \
	$(foreach u,$(sort $(PIP_FIND_LINKS) $(shell $(call PIP_GET,find-links))),--find-links $(u))
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	( $(BIN)/pip install -q --disable-pip-version-check -c constraints.txt uv \
	  && $(BIN)/uv pip install -q --python $(BIN)/python $(UV_SOURCES) -c constraints.txt -e '.[test]' ) \
	|| $(BIN)/pip install -q --disable-pip-version-check --no-compile -c constraints.txt -e '.[test]'
	$(BIN)/python -m compileall -qq -j 0 $(SITE)/torch $(SITE)/numpy $(SITE)/scipy $(SITE)/sympy || true
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m meshplan.demo

demo-pipeline: $(STAMP)
	$(BIN)/python -m meshplan.demo_pipeline --nproc 4

# The plan report's tests render it in headless Chromium (Debian's package; CI runs as root).
CHROMIUM := /usr/bin/chromium
$(CHROMIUM):
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium > /dev/null

# Two pytest workers (pytest-xdist), a whole test file at a time (--dist loadfile) so a module's
# fixtures are built once. The tests' own processes leave a core idle much of a serial run: on
# the 2-core machine the suite took 8 min 15 s this way against 11 min 02 s serially (same
# CPU time). `pytest tests` alone still runs serially. --no-loadscope-reorder: files in
# collection order, the longest first (tests/conftest.py), not xdist's order by test count.
# Bytecode written even where the environment says not to (PYTHONDONTWRITEBYTECODE): the
# suite starts a few hundred processes, each compiling meshplan (0.2 s) and what compileall
# left out again otherwise.
test: $(STAMP) $(CHROMIUM)
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest tests -n 2 --dist loadfile --no-loadscope-reorder

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
