"""Time to first token of one long prompt through `k3 serve`, with and without the segmented KDA
prefill (k3.ops.kda.segmented): the same random-weight checkpoint served twice, once with
`kda_impl` "auto" (the dispatcher may segment) and once pinned to "fla" (fla's kernel alone).

    python -m bench.long_prefill [--tokens 131072] [--device cuda] [--heads 12] [--layers 4]

The model is K3-proportioned (k3-slice: K3's hidden size, head shapes, latent MoE, SiTU, AttnRes,
3:1 KDA:MLA) with 12 KDA and MLA heads per layer (one rank's share at tensor parallelism 8), bf16
weights. The prompt goes in as token ids to /v1/completions (max_tokens 1, streamed); TTFT is the
time to the first streamed chunk, the best of `--repeats` after one warm-up request (which also
compiles and autotunes the kernels). The whole prompt runs as one prefill step
(`--max-num-batched-tokens` = the prompt). `--device cpu --tokens 2048 --hidden 128 --baseline auto` is a smoke run (on CPU
both folders take the torch paths).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from k3.checkpoint.official import save_pretrained
from k3.config import load_config
from k3.model.transformer import K3ForCausalLM
from k3.text.tokenizer import TOKENIZER_FILE, train_tokenizer


def build_folder(root: Path, args) -> tuple[Path, Path]:
    """Two folders over the same weights: kda_impl auto / the baseline's."""
    changes = {"kda_num_heads": args.heads, "num_attention_heads": args.heads, "num_key_value_heads": args.heads,
               "num_hidden_layers": args.layers}
    if args.hidden:  # smoke runs: a narrow model
        changes.update(hidden_size=args.hidden, intermediate_size=4 * args.hidden, moe_intermediate_size=args.hidden,
                       routed_expert_hidden_size=args.hidden, q_lora_rank=args.hidden // 2, kv_lora_rank=64)
    cfg = load_config("k3-slice").replace(**changes)
    layers = range(1, args.layers + 1)  # 1-indexed, every fourth an MLA layer
    cfg = cfg.replace(kda_layers=[i for i in layers if i % 4], full_attn_layers=[i for i in layers if not i % 4])
    dtype = torch.bfloat16 if args.device != "cpu" else torch.float32
    with torch.device(args.device):
        model = K3ForCausalLM(cfg).to(dtype)
    tok = train_tokenizer(["a b c"], 300)
    folders = []
    for impl in ("auto", args.baseline):
        folder = root / ("base" if folders else "auto")
        if impl == "auto":
            save_pretrained(model, folder)
        else:
            folder.mkdir()
            for f in (root / "auto").iterdir():
                if f.suffix == ".safetensors" or f.name.endswith(".index.json"):
                    (folder / f.name).symlink_to(f)
            (folder / "config.json").write_text(json.dumps(model.config.replace(kda_impl=impl).to_dict(), indent=2))
        tok.save(str(folder / TOKENIZER_FILE))
        folders.append(folder)
    del model
    return folders[0], folders[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ttft(folder: Path, args, log: Path) -> list[float]:
    port = free_port()
    budget = args.tokens + 64
    cmd = [sys.executable, "-m", "k3", "serve", "--model", str(folder), "--device", args.device, "--port", str(port),
           "--max-model-len", str(budget), "--max-num-batched-tokens", str(budget), "--max-num-seqs", "1",
           "--max-request-bytes", str(16 * args.tokens + (1 << 20)), "--no-prefix-caching", "--cache-mb", str(args.cache_mb), "--served-model-name", "k3", "--log-level", "info"]
    if args.device != "cpu":
        cmd += ["--dtype", "bfloat16"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "K3_LOG_LEVEL": "INFO"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"long_prefill: the server did not come up (log: {log})\n" + log.read_text()[-3000:])
            time.sleep(1)
        prompt = torch.randint(10, 290, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
        body = {"model": "k3", "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
        times, prompts_done = [], []
        for _ in range(1 + args.repeats):
            start = time.perf_counter()
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=900) as r:
                if r.status_code != 200:
                    raise SystemExit(f"long_prefill: HTTP {r.status_code}: {r.read()[:500]!r}")
                for line in r.iter_lines():  # read to the end: the request finishes before the next
                    if '"error"' in line:
                        raise SystemExit(f"long_prefill: the server answered an error: {line[:300]}")
                    if line.startswith("data:") and len(times) < len(prompts_done) + 1:
                        times.append(time.perf_counter() - start)
                prompts_done.append(1)
        return times[1:]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=0, help="a narrower model (smoke runs); 0: K3's 7168")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache-mb", type=int, default=8192, help="the server's page pool (holds the whole prompt)")
    ap.add_argument("--baseline", default="fla", help="the second folder's kda_impl (default fla)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        auto, base = build_folder(Path(tmp), args)
        seg = ttft(auto, args, Path(tmp) / "auto.log")
        plain = ttft(base, args, Path(tmp) / "base.log")
        chosen = [line for line in (Path(tmp) / "auto.log").read_text().splitlines() if "ops.kda" in line]
    name = torch.cuda.get_device_name() if args.device != "cpu" else "cpu"
    print(f"# {name}, {args.tokens}-token prompt, k3-slice widths, {args.heads} KDA heads x {args.layers} layers")
    print(f"TTFT s (best of {args.repeats}): segmented-capable {min(seg):.3f} {seg}, baseline {min(plain):.3f} "
          f"{plain}; ratio {min(plain) / min(seg):.2f}x")
    print("kda paths logged:", chosen[:4])


if __name__ == "__main__":
    main()
