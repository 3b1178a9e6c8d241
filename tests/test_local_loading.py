"""Rank-local loading (issue 26.3): each rank reads only the rows of each global batch it
computes on (`meshplan.data`) — in a pipeline only its stages' tensors — through a plain
`DataLoader` (or a Hugging Face dataset) with `LocalBatchSampler`, and ``parallelize(...,
local_batches=True)`` trains on them equal to one device, losses counting the whole batch's
targets over micro-batches included. The bytes each rank loads are counted and equal its
share."""

from __future__ import annotations

import functools

import pytest
import torch

from meshplan.data import LocalBatchSampler, rank_rows, rank_tensors
from meshplan.zoo.spec import build_workload
from oracle import SGD, cpu_capture, make_plan
from user_loop import one_device, parallel, train_steps

GPT = "gpt:hidden=64,layers=2,heads=4,seq=16,vocab=128,batch=8"
SAMPLES, STEPS = 32, 3


class Tokens(torch.utils.data.Dataset):
    """Sequences and their targets (``padded``: some targets -100, a different count of real
    ones in every micro-batch); serves only the ``tensors`` asked for, counting the bytes."""

    def __init__(self, tensors=("input0", "target"), padded: bool = False) -> None:
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, 128, (SAMPLES, 16), generator=g)
        self.targets = torch.randint(0, 128, (SAMPLES, 16), generator=g)
        if padded:
            for i in range(SAMPLES):
                self.targets[i, 16 - (i * 5) % 13:] = -100
        self.tensors, self.served = tensors, 0

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        out = (self.ids[i] if "input0" in self.tensors else None,
               self.targets[i] if "target" in self.tensors else None)
        self.served += sum(t.nbytes for t in out if t is not None)
        return out


def _collate(rows):
    ids, targets = zip(*rows)
    stack = lambda ts: None if ts[0] is None else torch.stack(ts)   # noqa: E731
    return ((stack(ids),), stack(targets))


def _global_batches(padded: bool = False) -> list:
    data = Tokens(padded=padded)
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=False, collate_fn=_collate)
    return list(loader)[:STEPS]


def _rank(rank: int, nprocs: int, plan, padded: bool = False) -> tuple[list[float], int]:
    w = build_workload(GPT, device="cpu", seed=0)
    sampler = LocalBatchSampler(SAMPLES, 8, plan, rank)
    data = Tokens(sampler.tensors, padded)   # loads only what this rank reads
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler, collate_fn=_collate)
    model, opt, sched = parallel(w, plan, local_batches=True, example_batch=w.example_batch,
                                 captured=cpu_capture(GPT, plan.microbatches))
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


@pytest.mark.parametrize("method,shape", [("data", (1, 2)), ("zero3", (1, 2))])
def test_a_loss_counting_the_whole_batch_trains_as_one_device(pool2, method: str,
                                                              shape) -> None:
    # A token mean over -100-padded targets, over 2 micro-batches: each micro-batch's scale
    # counts the real targets of the whole global micro-batch, gathered from the ranks' rows.
    plan = make_plan(GPT, shape, method, SGD, microbatches=2)
    ref, _ = one_device(build_workload(GPT, device="cpu", seed=0), _global_batches(True))
    per_sample = Tokens().ids[0].nbytes * 2
    for losses, served in pool2.run(_rank, plan, True):
        assert losses == pytest.approx(ref, rel=1e-5)
        assert served == STEPS * 4 * per_sample


def _pipeline_plan(devices: int, microbatches: int):
    import meshplan.api as api
    w = build_workload(GPT, device="meta", seed=0)
    return api.plan(w.model, w.loss_fn, SGD, w.example_batch, f"local:{devices}",
                    method=f"megatron:dp={devices // 2},tp=1,pp=2", memory_budget_gb=0,
                    microbatches=microbatches, dtype="fp32")


def test_a_pipeline_rank_loads_only_its_stage_tensors(pool2) -> None:
    plan = _pipeline_plan(2, 2)
    assert [rank_tensors(plan, r) for r in (0, 1)] == [("input0",), ("target",)]
    ref, _ = one_device(build_workload(GPT, device="cpu", seed=0), _global_batches(True))
    ids_bytes = Tokens().ids[0].nbytes
    for losses, served in pool2.run(_rank, plan, True):
        assert losses == pytest.approx(ref, rel=1e-5)
        assert served == STEPS * 8 * ids_bytes   # every row, of one tensor


def test_a_data_parallel_pipeline_on_four_ranks(pool4) -> None:
    plan = _pipeline_plan(4, 2)
    ref, _ = one_device(build_workload(GPT, device="cpu", seed=0), _global_batches(True))
    ids_bytes = Tokens().ids[0].nbytes
    for losses, served in pool4.run(_rank, plan, True):
        assert losses == pytest.approx(ref, rel=1e-5)
        assert served == STEPS * 4 * ids_bytes   # its replica's half, of its stage's tensor


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
    model, opt, sched = parallel(w, plan, local_batches=True, example_batch=w.example_batch,
                                 captured=cpu_capture(GPT, plan.microbatches))
    batches = loader(sampler)
    first = train_steps(model, opt, sched, [next(batches) for _ in range(2)])
    meshplan.save_checkpoint(path, model, opt, extra={"sampler": sampler.state_dict()})
    third = train_steps(model, opt, sched, [next(batches)])

    again = LocalBatchSampler(len(data), 8, plan, rank, shuffle=True, seed=1)
    model, opt, sched = parallel(w, plan, local_batches=True, example_batch=w.example_batch,
                                 captured=cpu_capture(GPT, plan.microbatches))
    again.load_state_dict(meshplan.load_checkpoint(path, model, opt)["sampler"])
    sched.step(), sched.step()   # the schedule's own position, as a user restores it
    resumed = train_steps(model, opt, sched, [next(loader(again))])
    return first + third, first + resumed


def test_a_resumed_run_reads_the_next_batch(pool2, tmp_path) -> None:
    plan = make_plan(GPT, (1, 2), "data", SGD)
    for straight, resumed in pool2.run(_resume_rank, plan, str(tmp_path / "ckpt")):
        assert resumed == pytest.approx(straight, rel=1e-6)


# ---------------------------------------------------------------- a Hugging Face dataset
def _hf_rows() -> dict[str, torch.Tensor]:
    """16 right-padded sequences of a causal LM, -100 labels on the padding."""
    import test_hf_models as hf
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, hf.VOCAB, (16, 8), generator=g)
    mask = torch.ones(16, 8, dtype=torch.long)
    for i in range(16):
        mask[i, 8 - i % 5:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _hf_plan(method: str, devices: int):
    import meshplan.api as api
    import test_hf_models as hf
    rows = _hf_rows()
    return api.plan(hf.build("llama"), None, SGD, {k: v[:8] for k, v in rows.items()},
                    f"local:{devices}", method=method, memory_budget_gb=0, microbatches=2,
                    dtype="fp32")


def _hf_steps(model, opt, batches, one_device: bool = False) -> list[float]:
    losses = []
    for b in batches:
        loss = model(**b).loss if one_device else model(b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _hf_rank(rank: int, nprocs: int, plan) -> tuple[list[float], tuple[str, ...]]:
    import datasets
    import meshplan
    import test_hf_models as hf
    from meshplan.runtime.optim import make_optimizer
    rows = _hf_rows()
    sampler = LocalBatchSampler(16, 8, plan, rank)
    table = datasets.Dataset.from_dict({k: v.tolist() for k, v in rows.items()})
    table = table.select_columns(list(sampler.tensors)).with_format("torch")
    loader = torch.utils.data.DataLoader(table, batch_sampler=sampler)
    model = hf.build("llama")
    opt = make_optimizer(SGD, model.parameters())
    model, opt = meshplan.parallelize(model, opt, plan, None, local_batches=True,
                                      example_batch={k: v[:8] for k, v in rows.items()})
    return _hf_steps(model, opt, list(loader)), tuple(table.column_names)


@pytest.mark.parametrize("method,devices", [("data", 2), ("megatron:dp=1,tp=1,pp=2", 2)])
def test_a_hugging_face_dataset_feeds_each_rank_its_rows(pool2, method: str,
                                                         devices: int) -> None:
    import test_hf_models as hf
    from meshplan.runtime.optim import make_optimizer
    plan = _hf_plan(method, devices)
    model = hf.build("llama")
    opt = make_optimizer(SGD, model.parameters())
    rows = _hf_rows()
    ref = _hf_steps(model, opt, [{k: v[i:i + 8] for k, v in rows.items()} for i in (0, 8)],
                    one_device=True)
    results = pool2.run(_hf_rank, plan)
    for losses, columns in results:
        assert losses == pytest.approx(ref, rel=1e-5)
    if plan.num_stages > 1:   # the first stage reads the inputs, the last the labels
        assert "labels" not in results[0][1] and "input_ids" not in results[1][1]


# ---------------------------------------------------------------- random plans
def _local_rank(comm, plan, w, data, captured) -> tuple:
    from meshplan.runtime.trainer import Trainer
    tr = Trainer(plan, w.model, w.loss_fn, w.example_batch, comm, captured=captured,
                 local_batches=True)
    rows = torch.tensor(rank_rows(plan, comm.rank, 4))
    losses = [tr.step({k: v.index_select(0, rows) for k, v in b.items()}, seed=i)
              for i, b in enumerate(data)]
    return losses, tr.full_state_dict(), []


@functools.cache
def _gpt2() -> tuple:
    """GPT-2 (dropout 0.1 on embeddings, attention and residuals), 2 batches, the one-device
    oracle and a capture at one of 2 micro-batches."""
    import test_random_plans as R
    from meshplan.capture.batch import split_microbatches
    from meshplan.capture.to_ir import capture
    w, data, ref, _ = R._gpt2()
    return w, data, ref, capture(w.model, None, split_microbatches(w.example_batch, 2)[0])


@pytest.mark.parametrize("shape", [(1, 2), (2, 1), (2, 2), (1, 4)],
                         ids=["1x2", "2x1", "2x2", "1x4"])
def test_random_plans_with_local_batches_equal_one_device(shape, monkeypatch) -> None:
    # GPT-2 as its authors wrote it (dropout, -100 labels on padding, its own token mean)
    # over 2 micro-batches: whatever split of the batch a random valid plan draws, each rank
    # given only its rows trains as one device (the whole batch's dropout masks, the token
    # counts gathered across the ranks).
    from meshplan.runtime.emulated import run_emulated
    from oracle import assert_matches
    from random_plans import random_plan
    import test_random_plans as R
    w, data, ref, captured = _gpt2()
    for seed in range(3):
        plan = random_plan(w.model, None, R.SGD, w.example_batch, shape,
                           8000 + 100 * shape[0] + 10 * shape[1] + seed, monkeypatch,
                           abstract=seed % 2 == 1, microbatches=2)
        for r in run_emulated(_local_rank, shape, plan, w, data, captured):
            assert_matches(r, ref, plan, R.SGD)


def test_uneven_shares_each_rank_loads_its_own() -> None:
    # HAP's uneven shares: rank 0 computes on 3 of every 4 rows, rank 1 on one; each loads
    # exactly those, the -100-padded token mean over 2 micro-batches counted whole.
    from meshplan.runtime.emulated import run_emulated
    from oracle import assert_matches, reference
    plan = make_plan(GPT, (1, 2), "data", SGD, microbatches=2,
                     axis_weights=((1.0,), (3.0, 1.0)))
    batches = _global_batches(True)
    w = build_workload(GPT, device="cpu", seed=0)
    rows = [rank_rows(plan, r, 8) for r in (0, 1)]
    assert rows == [[0, 1, 2, 4, 5, 6], [3, 7]]

    def body(comm) -> tuple:
        from meshplan.runtime.trainer import Trainer
        tr = Trainer(plan, w.model, w.loss_fn, w.example_batch, comm, local_batches=True)
        mine = rows[comm.rank]
        losses = [tr.step(((ids[mine],), t[mine]), seed=i) for i, ((ids,), t) in
                  enumerate(batches)]
        return losses, tr.full_state_dict(), []

    ref = reference(w, SGD, batches)
    for r in run_emulated(body, (1, 2)):
        assert_matches(r, ref, plan, SGD)
