"""Seconds per post-training forward + backward, whole rows against shared prefixes (k3/train/prefix_tree.py).

    python -m bench.shared_prefix --run runs/k3-tiny-<ts> [--steps 4] [--threads 1]

Two rows, each timed both ways on the same weights, alternating so that load on the machine slows
both alike; prints each repeat and the medians:
- sft: the default `k3 sft` step (8 default-set conversations, its packed row) from RUN;
- rl: 8 prompts of 150 random tokens x 8 samples of 10-60 tokens (a `k3 rl` row's shape).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from k3.threads import configure


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, help="a `k3 train` run (the SFT rows start from it)")
    ap.add_argument("--steps", type=int, default=4, help="repeats of each row (default 4)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    print(configure(args.threads).describe())
    import torch  # after configure: torch reads the thread settings

    from k3.rl.objective import pack_trajectories, token_logprobs
    from k3.sft.trainer import SFTSettings, SFTTrainer

    with tempfile.TemporaryDirectory() as tmp:
        sft = SFTTrainer(SFTSettings(init=args.run, out=str(Path(tmp) / "sft"), agent_episodes=0),
                         progress=False, log=lambda *a: None)
        model = sft.model
        g = torch.Generator().manual_seed(0)
        trajectories = []
        for _ in range(8):
            prompt = torch.randint(3, model.config.vocab_size, (150,), generator=g).tolist()
            for _ in range(8):
                n = int(torch.randint(10, 61, (1,), generator=g))
                completion = torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist()
                trajectories.append(SimpleNamespace(prompt_ids=prompt, completion_ids=completion,
                                                    logprobs=[-1.0] * n, versions=[0] * n))
        rl_batch = pack_trajectories(trajectories, torch.randn(len(trajectories), generator=g).tolist())

        def sft_step(share: bool, step: int) -> float:
            sft.s = dataclasses.replace(sft.s, share_prefixes=share)
            sft.step = step
            batch = sft.pack_items(sft.step_items()[0])
            t0 = time.perf_counter()
            sft._loss_sum(batch).backward()
            return time.perf_counter() - t0

        def rl_step(share: bool, step: int) -> float:
            t0 = time.perf_counter()
            (token_logprobs(model, rl_batch, share_prompts=share) * rl_batch.advantages).sum().backward()
            return time.perf_counter() - t0

        for name, fn, tokens in (("sft", sft_step, None), ("rl", rl_step, rl_batch.input_ids.shape[1])):
            fn(False, 0), fn(True, 0)  # warm-up: allocator and first-call costs
            model.zero_grad(set_to_none=True)
            times = {False: [], True: []}
            for step in range(args.steps):
                for share in (False, True):
                    times[share].append(fn(share, step))
                    model.zero_grad(set_to_none=True)
            whole, shared = statistics.median(times[False]), statistics.median(times[True])
            size = f", {tokens:,} packed tokens" if tokens else ""
            print(f"{name}{size}: whole {whole:.2f} s, shared {shared:.2f} s ({whole / shared:.2f}x); whole "
                  + " ".join(f"{t:.2f}" for t in times[False]) + ", shared " + " ".join(f"{t:.2f}" for t in times[True]))
        sft.close()


if __name__ == "__main__":
    main()
