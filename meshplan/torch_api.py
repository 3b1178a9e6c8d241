"""The torch meshplan runs on: the version it needs, and every private or version-dependent torch
API it uses, each imported here once (DESIGN.md §3.1), so a torch that lacks one fails at import
with a message naming it instead of deep inside a trace or a collective.

meshplan declares ``torch>=2.11`` (users bring their own CUDA build); its tests pin 2.13.0.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

MIN_TORCH = (2, 11)


def torch_version(text: str | None = None) -> tuple[int, int]:
    """(major, minor) of ``text`` (default: the installed torch's version string)."""
    found = re.match(r"(\d+)\.(\d+)", text if text is not None else torch.__version__)
    if found is None:
        raise RuntimeError(f"cannot read torch's version from {text or torch.__version__!r}")
    return int(found[1]), int(found[2])


def check_torch(text: str | None = None) -> None:
    """ImportError unless the torch of ``text`` (default: installed) is at least `MIN_TORCH`."""
    have = torch_version(text)
    if have < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        raise ImportError(f"meshplan needs torch>={need}, found torch {text or torch.__version__}:"
                          f" pip install 'torch>={need}' (your CUDA build of it)")


def _private(module: str, names: str):
    """``names`` (space-separated) from torch's private ``module``, or an ImportError naming
    them and the torch version."""
    import importlib
    try:
        mod = importlib.import_module(module)
        return tuple(getattr(mod, n) for n in names.split())
    except (ImportError, AttributeError) as e:
        raise ImportError(f"meshplan uses {module}.{{{names.replace(' ', ', ')}}}, which torch "
                          f"{torch.__version__} lacks ({e}); meshplan is tested on torch 2.11-2.13"
                          ) from e


check_torch()

# Tracing on fake tensors (capture/).
(FakeTensorMode, is_fake, DynamicOutputShapeException,
 DataDependentOutputException) = _private(
    "torch._subclasses.fake_tensor",
    "FakeTensorMode is_fake DynamicOutputShapeException DataDependentOutputException")
(make_fx, get_proxy_mode, get_proxy_slot) = _private(
    "torch.fx.experimental.proxy_tensor", "make_fx get_proxy_mode get_proxy_slot")
(OpOverload,) = _private("torch._ops", "OpOverload")
# Graph modules whose Python code is generated when first run, not on every edit: capture's
# passes edit graphs of thousands of nodes that planning only reads.
(lazy_graph_modules,) = _private("torch.fx._lazy_graph_module", "_use_lazy_graph_module")

# Equal-size collectives into one tensor: torch 2.13 renamed them (the old names warn).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def world_timeout():
    """The initialized world's collective timeout (a timedelta), or None when this torch does
    not expose it: groups meshplan creates inherit it (``new_group`` would otherwise take
    torch's 30-minute default, and a lost peer would hang a receive that long)."""
    try:
        world = dist.group.WORLD
        device = torch.device("cuda" if "nccl" in str(dist.get_backend()) else "cpu")
        return world._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


def new_group(ranks: list[int]):
    """``dist.new_group(ranks)`` with the world's timeout (`world_timeout`)."""
    return dist.new_group(ranks, timeout=world_timeout())
