"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): saved under one plan, resumed under
another, or loaded whole into the plain model.

Every tensor is stored under its name in the original model as one global tensor
(``model.<name>``; each optimizer state shaped like it, ``optim.<name>.<key>``), each rank
writing the region it holds: its piece of the layout, or under ZeRO its rows of that piece.
Buffers the program reads (batch norm's running statistics) are stored whole, as every rank
holds them.
Replicas write the same region (DCP keeps one); a parameter several pipeline stages hold
(a tied embedding) is written by the first. Resuming, each rank reads the region the *new*
plan gives it, whatever the old one cut — DCP assembles it from the stored chunks — so a
checkpoint moves between meshes, stage layouts, update modes and ZeRO levels. Optimizer
scalars (Adam's step), the parameter groups' hyper-parameters and the caller's ``extra``
(say, the step number) go into ``meshplan.json`` beside the tensors, with each tensor's shape,
so a checkpoint of another model is refused by name.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import (LoadPlan, ReadItem, SavePlan,
                                                  TensorWriteData, WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from meshplan.lower.shards import piece_offsets
from meshplan.runtime.collectives import shard_sizes
from meshplan.runtime.trainer import Trainer

META = "meshplan.json"


@dataclass(frozen=True)
class Region:
    """A rank's part of one global tensor: ``tensor`` holds ``[offsets, offsets + shape)``."""

    key: str
    tensor: torch.Tensor
    offsets: tuple[int, ...]
    size: tuple[int, ...]   # the global tensor's


def _regions(trainer: Trainer, optimizer: torch.optim.Optimizer | None, keep: set[str]
             ) -> list[Region]:
    """The regions of ``trainer``'s parameters in ``keep`` and of their optimizer state."""
    out = []
    for p in trainer.params:
        if p.name not in keep:
            continue
        v = trainer.program.values[p.node]
        piece = piece_offsets(v, trainer.pos)
        starts = [s for s, _ in piece]
        if p.mode in ("zero2", "zero3"):   # the update tensor: my rows of the piece
            rows = shard_sizes(piece[0][1], trainer.comm.group_size(p.axes))
            starts[0] += sum(rows[:trainer.comm.group_index(p.axes)])
        update_at = tuple(starts)
        value = p.update if p.mode == "zero3" else p.compute
        at = update_at if p.mode == "zero3" else tuple(s for s, _ in piece)
        out.append(Region(f"model.{p.name}", value.detach(), at, tuple(v.shape)))
        state = optimizer.state.get(p.update, {}) if optimizer is not None else {}
        for k, t in state.items():
            if isinstance(t, torch.Tensor) and t.shape == p.update.shape and t.dim() > 0:
                out.append(Region(f"optim.{p.name}.{k}", t, update_at, tuple(v.shape)))
    return out


def _buffer_regions(trainer: Trainer, keep: set[str]) -> list[Region]:
    """The regions of ``trainer``'s buffers in ``keep`` (by state name): each whole on every
    rank, so every rank holds the whole tensor."""
    out = []
    for name, node in trainer._buffer_node.items():
        if name in keep:
            t = trainer.buffers[node]
            out.append(Region(f"model.{name}", t, (0,) * t.dim(), tuple(t.shape)))
    return out


def _engines(model: Any) -> list[tuple[int, Trainer]]:
    """(stage, trainer) of every stage this rank runs."""
    if model._pipeline is not None:
        return sorted(model._pipeline.trainers.items())
    if model._trainer is None:
        raise RuntimeError("the parallel model has not run yet: call it on a batch first (or "
                           "load a checkpoint, which it applies when it starts)")
    return [(0, model._trainer)]


def _first_holders(model: Any) -> dict[str, int]:
    """Each parameter's first stage (a parameter several stages hold is written by it)."""
    plan = model._plan
    if plan.num_stages <= 1:
        return {}
    first: dict[str, int] = {}
    for s in plan.stages:
        for p in s.plan.params:
            first.setdefault(p.name, s.index)
    return first


class _SavePieces(DefaultSavePlanner):
    def __init__(self, regions: list[Region]) -> None:
        super().__init__()
        self.regions = {r.key: r for r in regions}

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(
            index=MetadataIndex(r.key, torch.Size(r.offsets)), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(torch.Size(r.offsets), r.tensor.shape),
                properties=TensorProperties.create_from_tensor(r.tensor),
                size=torch.Size(r.size)))
            for r in self.regions.values()]
        # planner_data: each key's path in the (flat) state dict, as the default planner keeps.
        self.plan = SavePlan(items, planner_data={k: (k,) for k in self.regions})
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self.regions[write_item.index.fqn].tensor.contiguous()


class _LoadPieces(DefaultLoadPlanner):
    def __init__(self, regions: list[Region]) -> None:
        super().__init__()
        self.regions = {r.key: r for r in regions}

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for r in self.regions.values():
            stored = self.metadata.state_dict_metadata[r.key]
            items += create_read_items_for_chunk_list(
                r.key, stored, [ChunkStorageMetadata(torch.Size(r.offsets), r.tensor.shape)])
        return LoadPlan(items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        t = self.regions[read_item.dest_index.fqn].tensor
        for d, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(d, start, length)
        return t


def save_checkpoint(path: str, model: Any, optimizer: torch.optim.Optimizer | None = None,
                    extra: dict[str, Any] | None = None) -> None:
    """Save ``model`` (from `meshplan.parallelize`) and ``optimizer`` to the directory ``path``
    (module docstring); collective: every rank calls it. ``extra`` must be JSON-serializable."""
    first = _first_holders(model)
    regions: list[Region] = []
    names: dict[str, list[int]] = {}
    buffers: dict[str, tuple[list[int], str]] = {}
    scalars: dict[str, dict[str, float]] = {}
    for stage, t in _engines(model):
        keep = {p.name for p in t.params if first.get(p.name, stage) == stage}
        regions += _regions(t, optimizer, keep)
        held = _buffer_regions(t, set(t._buffer_node) - set(buffers))   # each once a rank
        regions += held
        buffers.update({r.key.removeprefix("model."): (list(r.size), str(r.tensor.dtype)
                                                        .removeprefix("torch."))
                        for r in held})
        for p in t.params:
            names[p.name] = list(t.program.values[p.node].shape)
            state = optimizer.state.get(p.update, {}) if optimizer is not None else {}
            scalars[p.name] = {k: float(v) for k, v in state.items()
                               if not (isinstance(v, torch.Tensor) and v.dim() > 0)}
    os.makedirs(path, exist_ok=True)
    dcp.save({r.key: r.tensor for r in regions}, checkpoint_id=path,
             planner=_SavePieces(regions))
    # Every rank's parameter names and scalars (pipeline stages hold different ones).
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (names, scalars, buffers))
    if dist.get_rank() == 0:
        meta = {"params": {}, "scalars": {}, "buffers": {},
                "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                 for g in (optimizer.param_groups if optimizer else [])],
                "optimizer": type(optimizer).__name__ if optimizer else None,
                "steps": max(t._steps for _, t in _engines(model)),
                "extra": extra or {}}
        for n, s, b in parts:
            meta["params"].update(n)
            meta["scalars"].update(s)
            meta["buffers"].update(b)
        with open(os.path.join(path, META), "w") as f:
            json.dump(meta, f, indent=1)
    dist.barrier()


def _meta(path: str) -> dict[str, Any]:
    file = os.path.join(path, META)
    if not os.path.isfile(file):
        raise ValueError(f"{path!r} is not a meshplan checkpoint (no {META}); save one with "
                         "meshplan.save_checkpoint")
    with open(file) as f:
        return json.load(f)


def load_checkpoint(path: str, model: Any, optimizer: torch.optim.Optimizer | None = None
                    ) -> dict[str, Any]:
    """Resume ``model`` and ``optimizer`` from ``path`` under the model's own plan, whatever
    plan saved it; returns the saved ``extra``. Before the model's first call the load waits
    until it starts. Raises ValueError for a checkpoint of another model."""
    if model._trainer is None and model._pipeline is None:
        model._pending = (path, optimizer)
        return _meta(path)["extra"]
    return apply_checkpoint(path, model, optimizer)


def apply_checkpoint(path: str, model: Any, optimizer: torch.optim.Optimizer | None
                     ) -> dict[str, Any]:
    """Read this rank's regions of ``path`` into the started ``model`` and ``optimizer``;
    returns the saved ``extra``."""
    meta = _meta(path)
    model._eval_model = None   # an evaluation copy of the state replaced
    stored = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    regions: list[Region] = []
    for _, t in _engines(model):
        for p in t.params:
            shape = list(t.program.values[p.node].shape)
            if meta["params"].get(p.name) != shape:
                raise ValueError(
                    f"checkpoint {path!r} is of another model: its parameter {p.name!r} is "
                    f"{meta['params'].get(p.name, 'missing')}, this model's is {shape}")
            if optimizer is not None and p.name in meta["scalars"]:
                state = optimizer.state[p.update]
                for k, v in meta["scalars"][p.name].items():
                    state[k] = torch.tensor(v)
                for key in stored:   # the state shaped like the parameter, read below
                    if key.startswith(f"optim.{p.name}."):
                        state[key.removeprefix(f"optim.{p.name}.")] = torch.zeros_like(p.update)
        regions += _regions(t, optimizer, {p.name for p in t.params})
        # Buffers (running statistics): a checkpoint of meshplan before it saved them has
        # none, and the model's own are kept.
        saved = meta.get("buffers", {})
        for name, node in t._buffer_node.items():
            if name in saved and saved[name][0] != list(t.buffers[node].shape):
                raise ValueError(f"checkpoint {path!r} is of another model: its buffer "
                                 f"{name!r} is {saved[name][0]}, this model's is "
                                 f"{list(t.buffers[node].shape)}")
        regions += _buffer_regions(t, {n for n in t._buffer_node if f"model.{n}" in stored})
        t._steps = meta["steps"]   # the next step's dropout seed, as if never stopped
    extra = set(meta["params"]) - {p.name for _, t in _engines(model) for p in t.params}
    if model._plan.num_stages <= 1 and extra:
        raise ValueError(f"checkpoint {path!r} is of another model: it has parameters this "
                         f"model lacks, e.g. {sorted(extra)[:3]}")
    with torch.no_grad():
        dcp.load({r.key: r.tensor for r in regions}, checkpoint_id=path,
                 planner=_LoadPieces(regions))
    if optimizer is not None:
        for group, saved in zip(optimizer.param_groups, meta["param_groups"]):
            group.update(saved)
    for _, t in _engines(model):
        t._refresh_zero2()
    return meta["extra"]


def load_model_state(path: str, into: torch.nn.Module | None = None
                     ) -> dict[str, torch.Tensor]:
    """The checkpoint's parameters and buffers whole, by their names in the original model; no
    torch.distributed world needed. ``into``: also copy them into that plain model's
    parameters and buffers (a tied one, such as an LM head sharing the embedding, through its
    first name, as the checkpoint stores it). Raises ValueError when ``into`` has a parameter the
    checkpoint lacks or holds at another shape."""
    meta = _meta(path)
    state = {f"model.{n}": torch.empty(shape) for n, shape in meta["params"].items()}
    state.update({f"model.{n}": torch.empty(shape, dtype=getattr(torch, dtype))
                  for n, (shape, dtype) in meta.get("buffers", {}).items()})
    with warnings.catch_warnings():   # "no process group: loading in one process" -- yes
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=path, no_dist=True)
    out = {k.removeprefix("model."): v for k, v in state.items()}
    if into is not None:
        params = dict(into.named_parameters())   # a tied parameter once, by its first name
        wrong = [n for n, p in params.items() if n not in out or out[n].shape != p.shape]
        wrong += [n for n, b in into.named_buffers() if n in out and out[n].shape != b.shape]
        if wrong:
            raise ValueError(f"checkpoint {path!r} is of another model: it lacks parameter(s) "
                             f"of this one or holds them at another shape, e.g. {wrong[:3]}")
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(out[n])
            for n, b in into.named_buffers():
                if n in out:   # (a checkpoint of meshplan before it saved buffers has none)
                    b.copy_(out[n])
    return out
