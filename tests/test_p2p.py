"""Point-to-point messages as in-order channels (`runtime/p2p.py`): the transport only ever
matches a pair's messages in the order they were sent (what NCCL requires: it ignores tags and
shares one stream per pair), while ranks receive them in any order, by tag, keeping each
message's dtype. Checked on emulated ranks and on gloo processes, with both ranks sending
before they receive."""

from __future__ import annotations

import torch

from meshplan.runtime.p2p import Mailbox, MailboxP2P
from meshplan.torch_api import check_torch


def _exchange(p2p) -> list[torch.Tensor]:
    """Both ranks send three messages of different dtypes and sizes, then receive the peer's
    in another order than it sent them."""
    peer = 1 - p2p.rank
    base = 10 * (p2p.rank + 1)
    p2p.send(torch.full((2, 3), float(base)), peer, tag=1, kind="activation")
    p2p.send(torch.arange(5, dtype=torch.int64) + base, peer, tag=2)
    p2p.send(torch.full((4,), float(base), dtype=torch.bfloat16), peer, tag=3)
    got = [p2p.recv((4,), peer, tag=3), p2p.recv((2, 3), peer, tag=1),
           p2p.recv((5,), peer, tag=2)]
    p2p.wait_all()
    return got


def _check(got: list[torch.Tensor], peer: int) -> None:
    base = 10 * (peer + 1)
    assert got[0].dtype == torch.bfloat16 and got[0].tolist() == [float(base)] * 4
    assert got[1].shape == (2, 3) and got[1].dtype == torch.float32
    assert torch.equal(got[1], torch.full((2, 3), float(base)))
    assert got[2].dtype == torch.int64 and got[2].tolist() == list(range(base, base + 5))


def test_messages_arrive_by_tag_in_any_order_emulated() -> None:
    import threading
    box = Mailbox(10.0)
    results: dict[int, list] = {}
    threads = [threading.Thread(target=lambda r=r: results.__setitem__(
        r, _exchange(MailboxP2P(r, box)))) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rank in (0, 1):
        _check(results[rank], 1 - rank)


def _gloo_exchange(rank: int, nprocs: int) -> list[torch.Tensor]:
    from meshplan.runtime.p2p import ProcessGroupP2P
    return _exchange(ProcessGroupP2P("cpu"))


def test_messages_arrive_by_tag_in_any_order_on_gloo(pool2) -> None:
    for rank, got in enumerate(pool2.run(_gloo_exchange)):
        _check(got, 1 - rank)


def test_a_torch_older_than_2_11_is_refused_by_name() -> None:
    import pytest
    check_torch("2.11.0+cu130")
    check_torch("2.13.0")
    with pytest.raises(ImportError, match=r"torch>=2.11, found torch 2.10.1.*pip install"):
        check_torch("2.10.1")
