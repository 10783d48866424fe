"""The host tier's copies (k3/serve/page_transfer.py) in step order: a write-back reads what the last
step wrote and is read before this step overwrites the page, a prefetch is readable the step after,
and a host page a prefetch reads is rewritten only after that read. On CUDA the main stream is held
back by `torch.cuda._sleep` so that a missing wait between the streams would show."""
from __future__ import annotations

import pytest
import torch

from k3.serve.page_transfer import PageTransfer

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def stall() -> None:
    if torch.cuda.is_available() and torch.cuda.current_stream().device.type == "cuda":
        torch.cuda._sleep(20_000_000)  # ~10 ms of main-stream work before what follows


@pytest.mark.parametrize("device", DEVICES)
def test_copies_keep_step_order(device):
    if device == "cuda":
        torch.cuda.set_device(0)
    pool = torch.zeros(16, 4096, dtype=torch.uint8, device=device)
    t = PageTransfer(pool, 4)
    assert t.host.is_pinned() == (device == "cuda")
    # the last step wrote page 3 (late, on CUDA); this step evicts it to host page 0 and prefetches
    # host page 0 back into page 9, then overwrites page 3 with its own work
    if device == "cuda":
        stall()
    pool[3].fill_(7)
    t.run([(3, 0)], [(0, 9)])
    pool[3].fill_(5)
    # the next step reads page 9, then evicts page 11 into host page 0 again while prefetching host
    # page 0 into page 10 (the write-back lands first: write-backs precede prefetches)
    t.run([], [])
    seen = pool[9].clone()
    if device == "cuda":
        stall()
    pool[11].fill_(4)
    t.run([(11, 0)], [(0, 10)])
    pool[11].fill_(6)
    t.run([], [])
    after = pool[10].clone()
    if device == "cuda":
        torch.cuda.synchronize()
    assert (seen == 7).all() and (after == 4).all() and (t.host[0] == 4).all()
    assert t.bytes == {"write_back": 2 * 4096, "prefetch": 2 * 4096} and t.prefetch_seconds >= 0
