"""Real gloo process groups: ProcessGroupComm against the emulation, launcher and pool failures.

Spawning a rank costs a torch import, so every test of a size shares the session's pool
(`conftest.py`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

from meshplan.errors import WorkerError
from meshplan.runtime import collectives as C
from meshplan.runtime.comm import Comm, ProcessGroupComm
from meshplan.runtime.emulated import run_emulated
from meshplan.runtime.launcher import launch
from meshplan.runtime.pool import WorkerPool
from uneven_impls import COPY_KEYS, SUM_KEYS, gloo_impl_program, oracle

AXES = [(0,), (1,), (0, 1)]


def rand(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def uneven(n: int) -> list[int]:
    return {1: [4], 2: [3, 1], 4: [2, 0, 3, 1]}[n]


def program(comm: Comm) -> dict[str, Any]:
    """Every collective over every axis with uneven shards, then an autograd chain."""
    out: dict[str, Any] = {}
    for axes in AXES:
        n, me, tag = comm.group_size(axes), comm.group_index(axes), "".join(map(str, axes))
        sizes, cols = uneven(n), C.shard_sizes(5, n)
        out["ar" + tag] = comm.all_reduce(rand((3, 4), comm.rank), axes, phase="forward")
        shard, full = rand((2, sizes[me]), comm.rank), rand((sum(sizes), 3), comm.rank)
        out["ag" + tag] = comm.all_gather(shard, axes, 1, sizes, phase="forward")
        out["rs" + tag] = comm.reduce_scatter(full, axes, 0, sizes, phase="update")
        # Broadcast impl: roots are group ranks (not global ranks in row 1 or the columns).
        out["agb" + tag] = comm.all_gather(shard, axes, 1, sizes, phase="forward", impl="broadcast")
        out["rsb" + tag] = comm.reduce_scatter(full, axes, 0, sizes, phase="update",
                                               impl="broadcast")
        x = rand((sizes[me], 2, 5), comm.rank)
        out["a2a" + tag] = comm.all_to_all(x, axes, 2, cols, 0, phase="forward", concat_sizes=sizes)
        out["a2a?" + tag] = comm.all_to_all(x, axes, 2, cols, 0, phase="backward")
    r, c = comm.mesh_shape
    x = rand((4, 6), 7).requires_grad_()
    h = C.split(comm, x, (1,), 1, C.shard_sizes(6, c))
    h = C.all_to_all(comm, h, (1,), 0, C.shard_sizes(4, c), 1, C.shard_sizes(6, c))
    h = C.reduce_scatter(comm, h * (comm.rank + 1), (0,), 1, C.shard_sizes(6, r))
    h = C.all_gather(comm, h, (0,), 1, C.shard_sizes(6, r), backward="reduce_scatter")
    (h**2).sum().backward()
    out["chain"], out["chain_grad"] = h.detach(), x.grad
    out["records"] = list(comm.records)
    return out


def gloo_program(rank: int, nprocs: int, mesh_shape: tuple[int, int]) -> dict[str, Any]:
    return program(ProcessGroupComm(mesh_shape))


@pytest.mark.parametrize("mesh", [(1, 2), (2, 1), (1, 4), (2, 2), (4, 1)])
def test_gloo_matches_emulation(mesh: tuple[int, int], request: pytest.FixtureRequest) -> None:
    pool = request.getfixturevalue(f"pool{mesh[0] * mesh[1]}")
    real = pool.run(gloo_program, mesh)
    emulated = run_emulated(program, mesh)
    for rank, (got, want) in enumerate(zip(real, emulated)):
        assert got["records"] == want["records"], f"rank {rank}"
        assert set(got) == set(want)
        for key in sorted(set(want) - {"records"}):
            torch.testing.assert_close(got[key], want[key], msg=f"rank {rank} {key}")
    # Gloo's sums are bitwise identical on every member of a group.
    assert all(torch.equal(real[0]["ar01"], res["ar01"]) for res in real)
    # A broadcast all-gather moves the same bits as the padded one.
    for res in real:
        assert all(torch.equal(res["agb" + t], res["ag" + t]) for t in ("0", "1", "01"))


@pytest.mark.parametrize("mesh", [(1, 4), (2, 2)])
def test_gloo_impls_on_uneven_shards(mesh: tuple[int, int], pool4: WorkerPool) -> None:
    """Sizes [4, 3, 2, 1] and [2, 0, 3, 1], forward and backward, both impls on gloo.

    Gathers are exact copies: bitwise the oracle's torch.cat under either impl. Sums are not
    bitwise across impls on gloo: its reduce-scatter and its reduce add the members in
    different orders (neither is member order), so they agree to float tolerance only; each is
    deterministic (a second run repeats its bits)."""
    want = oracle(4)
    runs = {impl: pool4.run(gloo_impl_program, mesh, impl) for impl in ("padded", "broadcast")}
    again = pool4.run(gloo_impl_program, mesh, "broadcast")
    for rank in range(4):
        padded, broadcast = runs["padded"][rank], runs["broadcast"][rank]
        for key in COPY_KEYS:
            assert torch.equal(padded[key], want[rank][key]), f"padded rank {rank} {key}"
            assert torch.equal(broadcast[key], want[rank][key]), f"broadcast rank {rank} {key}"
        for key in SUM_KEYS:
            torch.testing.assert_close(padded[key], want[rank][key], msg=f"rank {rank} {key}")
            torch.testing.assert_close(broadcast[key], padded[key], msg=f"rank {rank} {key}")
            assert torch.equal(again[rank][key], broadcast[key]), f"rank {rank} {key} changed"
        kinds = [(r.kind, r.nbytes, r.axes, r.phase) for r in padded["records"]]
        assert kinds == [(r.kind, r.nbytes, r.axes, r.phase) for r in broadcast["records"]]
        assert {r.impl for r in broadcast["records"]} == {"broadcast"}


def raise_mid_collective(rank: int, nprocs: int) -> int:
    comm = ProcessGroupComm((1, nprocs))
    comm.all_reduce(torch.ones(2), (1,), phase="forward")
    if rank == 1:
        raise ValueError("rank one refuses to continue")
    comm.all_reduce(torch.ones(2), (1,), phase="forward")  # rank 0 waits here for the dead peer
    return rank


def exit_mid_collective(rank: int, nprocs: int) -> int:
    comm = ProcessGroupComm((1, nprocs))
    comm.all_reduce(torch.ones(2), (1,), phase="forward")
    if rank == 1:
        os._exit(3)
    comm.all_reduce(torch.ones(2), (1,), phase="forward")
    return rank


def rank_and_sum(rank: int, nprocs: int, scale: float) -> tuple[int, float]:
    comm = ProcessGroupComm((nprocs, 1))
    return rank, float(comm.all_reduce(torch.tensor([scale * rank]), (0,), phase="forward"))


def test_launch_returns_results_in_rank_order() -> None:
    assert launch(rank_and_sum, 2, (2.0,)) == [(0, 2.0), (1, 2.0)]


def _environment(rank: int, nprocs: int, key: str) -> tuple[str | None, str]:
    return os.environ.get(key), os.environ["LOCAL_RANK"]


def test_cpu_workers_fork_from_a_server_with_the_parents_environment(monkeypatch) -> None:
    """CPU workers fork from a fork server (imports made once) yet see the environment the
    parent has when the pool starts, as spawned ones would; where workers may take GPUs they
    are spawned, CUDA being unusable in a child of a process that initialized it."""
    from meshplan.runtime import pool
    assert pool._start_context("cpu").get_start_method() == "forkserver"
    monkeypatch.setenv("MESHPLAN_TEST_VALUE", f"set at {time.time()}")
    got = launch(_environment, 2, ("MESHPLAN_TEST_VALUE",))
    assert got == [(os.environ["MESHPLAN_TEST_VALUE"], "0"),
                   (os.environ["MESHPLAN_TEST_VALUE"], "1")]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pool._start_context(None).get_start_method() == "spawn"
    assert pool._start_context("cuda").get_start_method() == "spawn"
    assert pool._start_context("cpu").get_start_method() == "forkserver"


def test_launch_reports_raising_rank_quickly() -> None:
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        launch(raise_mid_collective, 2)
    assert time.monotonic() - start < 60
    assert info.value.rank == 1
    assert "ValueError: rank one refuses to continue" in str(info.value)
    assert "raise_mid_collective" in info.value.traceback


def test_launch_reports_dead_rank_quickly() -> None:
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        launch(exit_mid_collective, 2)
    assert time.monotonic() - start < 60
    assert info.value.rank == 1
    assert "exited with code 3" in str(info.value)


def sleep_then_return(rank: int, nprocs: int, seconds: float) -> int:
    time.sleep(seconds)
    return rank


def test_pool_deadline_stops_workers_and_closes_pool() -> None:
    pool = WorkerPool(2, timeout_s=120)
    assert pool.run(sleep_then_return, 0.0) == [0, 1]
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        pool.run(sleep_then_return, 30.0, timeout_s=0.5)
    assert time.monotonic() - start < 10
    assert not any(proc.is_alive() for proc in pool._procs)
    with pytest.raises(RuntimeError, match="closed"):
        pool.run(sleep_then_return, 0.0)
    pool.close()  # idempotent


def test_pool_rejects_unpicklable_function(pool2: WorkerPool) -> None:
    with pytest.raises(TypeError, match="picklable"):
        pool2.run(lambda rank, nprocs: rank)
    assert pool2.run(sleep_then_return, 0.0) == [0, 1]  # the pool is still usable


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="nprocs"):
        WorkerPool(0)
    with pytest.raises(ValueError, match="timeout_s"):
        launch(rank_and_sum, 2, (1.0,), timeout_s=0)
