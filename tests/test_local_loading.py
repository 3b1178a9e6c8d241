"""Rank-local loading (issue 26.3): each rank reads only the rows of each global batch it
computes on (`meshplan.data`), through a plain `DataLoader` with `LocalBatchSampler`, and
``parallelize(..., local_batches=True)`` trains on them equal to one device. The bytes each
rank loads are counted and equal its share."""

from __future__ import annotations

import pytest
import torch

from meshplan.data import LocalBatchSampler, rank_rows
from meshplan.zoo.spec import build_workload
from oracle import SGD, make_plan
from user_loop import one_device, parallel, train_steps

GPT = "gpt:hidden=64,layers=2,heads=4,seq=16,vocab=128,batch=8"
SAMPLES, STEPS = 32, 3


class Tokens(torch.utils.data.Dataset):
    """Sequences and their targets; counts the bytes it serves."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, 128, (SAMPLES, 16), generator=g)
        self.targets = torch.randint(0, 128, (SAMPLES, 16), generator=g)
        self.served = 0

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        self.served += self.ids[i].nbytes + self.targets[i].nbytes
        return self.ids[i], self.targets[i]


def _collate(rows):
    ids, targets = zip(*rows)
    return ((torch.stack(ids),), torch.stack(targets))


def _global_batches() -> list:
    data = Tokens()
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=False, collate_fn=_collate)
    return list(loader)[:STEPS]


def _rank(rank: int, nprocs: int, plan) -> tuple[list[float], int]:
    w = build_workload(GPT, device="cpu", seed=0)
    data = Tokens()
    sampler = LocalBatchSampler(len(data), 8, plan, rank)
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler, collate_fn=_collate)
    model, opt, sched = parallel(w, plan, local_batches=True, example_batch=w.example_batch)
    batches = [b for _, b in zip(range(STEPS), loader)]
    return train_steps(model, opt, sched, batches), data.served


@pytest.mark.parametrize("method,shape", [("data", (1, 2)), ("megatron", (1, 2))])
def test_each_rank_loads_its_share_and_trains_as_one_device(pool2, method: str, shape) -> None:
    plan = make_plan(GPT, shape, method, SGD)
    ref, _ = one_device(build_workload(GPT, device="cpu", seed=0), _global_batches())
    per_sample = Tokens().ids[0].nbytes * 2
    for rank, (losses, served) in enumerate(pool2.run(_rank, plan)):
        assert losses == pytest.approx(ref, rel=1e-5)
        # Data parallel: half the rows each; Megatron's two ranks split the tensors of the
        # same rows, so each reads them all.
        share = 4 if method == "data" else 8
        assert served == STEPS * share * per_sample
        assert len(rank_rows(plan, rank, 8)) == share


def test_four_ranks_two_replicas(pool4) -> None:
    plan = make_plan(GPT, (2, 2), "megatron", SGD)
    ref, _ = one_device(build_workload(GPT, device="cpu", seed=0), _global_batches())
    per_sample = Tokens().ids[0].nbytes * 2
    results = pool4.run(_rank, plan)
    for rank, (losses, served) in enumerate(results):
        assert losses == pytest.approx(ref, rel=1e-5)
        assert served == STEPS * 4 * per_sample   # its replica's half of each batch
    # The two replicas read disjoint halves; the two ranks of a replica the same half.
    rows = [rank_rows(plan, r, 8) for r in range(4)]
    assert rows[0] == rows[1] and rows[2] == rows[3] and not set(rows[0]) & set(rows[2])


def test_rows_follow_the_micro_batches_and_pipeline_stages() -> None:
    plan = make_plan(GPT, (1, 2), "data", SGD, microbatches=2)
    # Each micro-batch of 4 rows is split in two: rank 0 reads rows 0-1 and 4-5.
    assert rank_rows(plan, 0, 8) == [0, 1, 4, 5] and rank_rows(plan, 1, 8) == [2, 3, 6, 7]
    sampler = LocalBatchSampler(16, 8, plan, 1, shuffle=True, seed=3)
    first = next(iter(sampler))
    state = sampler.state_dict()
    again = LocalBatchSampler(16, 8, plan, 1, shuffle=True, seed=3)
    again.load_state_dict(state)   # resumed where it was: the next batch, not the first
    assert next(iter(again)) != first and len(first) == 4 and sampler.state_dict() == state


def test_refusals_are_clear() -> None:
    import meshplan
    plan = make_plan(GPT, (1, 2), "data", SGD)
    w = build_workload(GPT, device="cpu", seed=0)
    opt = torch.optim.SGD(w.model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="needs example_batch="):
        meshplan.parallelize(w.model, opt, plan, w.loss_fn, comm=object(), local_batches=True)
    with pytest.raises(ValueError, match="give 1 <= batch_size"):
        LocalBatchSampler(4, 8, plan, 0)


def test_a_loss_needing_the_whole_batch_is_refused_with_local_batches() -> None:
    from meshplan.runtime.emulated import run_emulated
    from meshplan.runtime.trainer import Trainer
    plan = make_plan(GPT, (1, 2), "data", SGD, microbatches=2)   # a token mean over 2 pieces
    w = build_workload(GPT, device="cpu", seed=0)

    def body(comm) -> None:
        tr = Trainer(plan, w.model, w.loss_fn, w.example_batch, comm, local_batches=True)
        rows = rank_rows(plan, comm.rank, 8)
        (ids,), t = _global_batches()[0]
        tr.step(((ids[rows],), t[rows]))

    with pytest.raises(NotImplementedError, match="give global batches"):
        run_emulated(body, (1, 2))


def _resume_rank(rank: int, nprocs: int, plan, path: str) -> tuple[list[float], list[float]]:
    """Two steps, a checkpoint with the sampler's position, then a fresh model, optimizer and
    sampler resumed from it for the third step; against three steps straight."""
    import meshplan
    w = build_workload(GPT, device="cpu", seed=0)
    data = Tokens()

    def loader(sampler):
        return iter(torch.utils.data.DataLoader(data, batch_sampler=sampler,
                                                collate_fn=_collate))

    sampler = LocalBatchSampler(len(data), 8, plan, rank, shuffle=True, seed=1)
    model, opt, sched = parallel(w, plan, local_batches=True, example_batch=w.example_batch)
    batches = loader(sampler)
    first = train_steps(model, opt, sched, [next(batches) for _ in range(2)])
    meshplan.save_checkpoint(path, model, opt, extra={"sampler": sampler.state_dict()})
    third = train_steps(model, opt, sched, [next(batches)])

    again = LocalBatchSampler(len(data), 8, plan, rank, shuffle=True, seed=1)
    model, opt, sched = parallel(w, plan, local_batches=True, example_batch=w.example_batch)
    again.load_state_dict(meshplan.load_checkpoint(path, model, opt)["sampler"])
    sched.step(), sched.step()   # the schedule's own position, as a user restores it
    resumed = train_steps(model, opt, sched, [next(loader(again))])
    return first + third, first + resumed


def test_a_resumed_run_reads_the_next_batch(pool2, tmp_path) -> None:
    plan = make_plan(GPT, (1, 2), "data", SGD)
    for straight, resumed in pool2.run(_resume_rank, plan, str(tmp_path / "ckpt")):
        assert resumed == pytest.approx(straight, rel=1e-6)
