"""Session-wide settings and fixtures: one torch thread, and gloo worker pools shared by the
whole session.

Spawning a rank costs a torch import and closing a pool a second or two more (about 6 s for 4
workers on 2 cores), which each module with real processes used to pay for its own pools. The
workers keep no state between runs that a test reads (each run builds its workload afresh).
Under `make test`'s two pytest-xdist workers each worker has its own pools (a session per
worker), and a test file runs whole on one worker (`--dist loadfile`).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest
import torch

from meshplan.runtime.pool import WorkerPool

# The tests' models are tiny and emulated ranks are threads of this process: with two intra-op
# threads per op, the ranks' OpenMP teams oversubscribe the 2 cores and spin waiting for each
# other (the 12 Wide-ResNet checks of `test_equivalence_zoo.py` took 82 s instead of 11 on a
# busy machine). The worker processes use one thread each for the same reason (`pool.py`).
torch.set_num_threads(1)

# The test processes keep millions of objects alive (torch, transformers, captured programs in
# their caches) and make millions more per file; Python's default thresholds (700, 10, 10) walked
# them in a full collection every few seconds: 5.0 of `test_equivalence_zoo.py`'s 47 s and 4.7
# of `test_hf_catalog.py` with `test_auto_vs_baselines.py`'s 84 s went to the cycle collector,
# 2.6 and 1.9 s with these (peak RSS the same, 487 MB; the planner pauses it on its own).
gc.set_threshold(50_000, 20, 100)

# Under `make test` each pytest-xdist worker is one of the two cores' streams already: a plan
# made in it prices on no forked workers of its own (`stage_costs.usable_cores`), which only
# added forks and pickling on a busy machine (the planning-heavy files 123 -> 118 s, twice).
# `test_stage_costs.py` still checks forked pricing against serial, asking for its workers.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("MESHPLAN_WORKERS", "1")


# Under `--dist loadfile` each worker takes the next file in collection order when it is done
# with one. Collected alphabetically, the longest files came late, and one worker ran them
# alone at the end: the last 3 % of the tests took three of nine minutes. They go first,
# longest first (seconds per file from `--durations=0`, 2026-12-02: 161 s for the deferred
# variants down to 28 s), and the many short files fill in around them. xdist (3.6 on) orders
# the files by their number of tests instead unless told not to (`make test`'s
# --no-loadscope-reorder): without it, the launchers' four tests ran last, alone.
LONGEST_FIRST = ("test_deferred_variants.py", "test_published_runs.py", "test_hf_models.py",
                 "test_partial_recompute.py", "test_launchers.py", "test_random_plans.py",
                 "test_inter_methods.py", "test_stage_costs.py", "test_simulate.py",
                 "test_pipeline_runtime.py", "test_devices.py", "test_equivalence_zoo.py",
                 "test_hf_catalog.py", "test_local_loading.py", "test_hetero_equivalence.py",
                 "test_demo_pipeline.py", "test_gpu_check.py", "test_adafactor.py",
                 "test_checkpoint.py", "test_memory_may_bind.py", "test_ilp.py",
                 "test_hetero_plan.py", "test_training_step.py", "test_equivalence_gloo.py",
                 "test_auto_vs_baselines.py", "test_parallelize.py", "test_batch_shapes.py",
                 "test_stage_dp.py", "test_calibrate.py", "test_equivalence_emulated.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: files stay whole


# pytest collects garbage once more as each worker ends (its unraisable-exception check, at
# unconfigure), over the million objects a worker still holds: 2.4 and 1.5 s after just two
# test files, 1.3 % of the suite's CPU samples (py-spy over `make test`, 2026-12-02), and at
# the very end, when the other worker is done too. What a test could still leave unraisable
# is not among what the session holds: frozen, that collection walks only what came after.
@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure() -> None:
    gc.freeze()


@pytest.fixture(scope="session")
def worker_pools() -> Iterator[dict[int, WorkerPool]]:
    pools: dict[int, WorkerPool] = {}
    yield pools
    for pool in pools.values():
        pool.close()


def _live(pools: dict[int, WorkerPool], nprocs: int) -> WorkerPool:
    # A worker that failed closes its pool: the next test gets a fresh one, so one failure
    # does not fail every later test of the session.
    if nprocs not in pools or pools[nprocs]._closed:
        pools[nprocs] = WorkerPool(nprocs)
    return pools[nprocs]


@pytest.fixture
def pool2(worker_pools: dict[int, WorkerPool]) -> WorkerPool:
    return _live(worker_pools, 2)


@pytest.fixture
def pool4(worker_pools: dict[int, WorkerPool]) -> WorkerPool:
    return _live(worker_pools, 4)
