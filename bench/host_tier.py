"""The prefix cache's host tier and auto-throttled admission on k3-tiny (random weights), CPU.

    python -m bench.host_tier --mode tier [--sessions 12 --turns 4 --first 192 --user 48 --reply 16]
    python -m bench.host_tier --mode admission [--requests 16 --prompt 256 --new 256 --sweep 3,4,6,8]

tier: a multi-session chat, rounds of one turn per session (at most --concurrency in flight), each
turn the session's history plus --user new tokens; a device pool of a third of the sessions' final
live prefixes (MLA pages + one KDA checkpoint each), and a host tier of --host-factor times that
(each turn leaves two checkpoints: at its prompt's end and where it stopped). Run without and with the
tier, interleaved --repeats times (load on the machine hits both alike): prefix tokens recomputed
(history tokens the cache did not serve), mean time to first token of the returning turns, and
whether the greedy outputs are identical.

admission: a burst of --requests long requests (ignore_eos, all at once) over a pool that fits a
quarter of them at full length: the fixed rule at max_num_seqs 64 (the old behaviour), a sweep of
fixed max_num_seqs, and the auto rule: output tokens per second of wall and of CPU time (one thread: the
CPU time moves less than the wall time when other jobs share the machine), preemptions, steps.
"""
from __future__ import annotations

import argparse
import statistics
import time

from k3.threads import configure


def model_and_layout(seed: int = 0):
    import torch

    from k3.config import load_config
    from k3.model.transformer import K3ForCausalLM
    from k3.serve.engine import EngineConfig, LLMEngine

    torch.manual_seed(seed)
    model = K3ForCausalLM(load_config("k3-tiny")).eval()
    return model, LLMEngine(model, EngineConfig(cache_bytes=1 << 20)).layout


def chat(engine, args, vocab: int):
    """One run of the chat workload -> (outputs, recomputed prefix tokens, returning TTFTs)."""
    import torch

    from k3.serve.sampling import SamplingParams

    g = torch.Generator().manual_seed(1)
    history = [[] for _ in range(args.sessions)]
    outputs, recomputed, ttft = [], 0, []
    params = SamplingParams(max_tokens=args.reply, temperature=0.0, ignore_eos=True)
    for turn in range(args.turns):
        todo = list(range(args.sessions))
        live: dict[str, tuple[int, list[int], float]] = {}
        got: dict[int, list[int]] = {}
        while todo or live:
            while todo and len(live) < args.concurrency:
                s = todo.pop(0)
                prompt = history[s] + torch.randint(3, vocab, (args.first if not turn else args.user,),
                                                    generator=g).tolist()
                r = engine.add_request(prompt, params, boundaries=(len(history[s]),) if turn else ())
                live[r.request_id] = (s, prompt, time.perf_counter())
                got[s] = []
            for o in engine.step():
                s, prompt, t0 = live[o.request_id]
                if not got[s] and o.new_tokens and turn:
                    ttft.append(time.perf_counter() - t0)
                got[s] += [t.token_id for t in o.new_tokens]
                if o.finished:
                    if turn:
                        recomputed += max(len(history[s]) - 1 - o.num_cached_tokens, 0)
                    history[s] = prompt + got[s]
                    del live[o.request_id]
        outputs += [got[s] for s in range(args.sessions)]
    return outputs, recomputed, ttft


def run_tier(args) -> None:
    from k3.serve.engine import EngineConfig, LLMEngine

    model, layout = model_and_layout()
    final = args.first + (args.turns - 1) * args.user + args.turns * args.reply
    live_pages = args.sessions * (layout.mla_pages_for(final) + layout.pages_per_state)
    device_pages = live_pages // 3
    host_pages = int(args.host_factor * live_pages)
    print(f"sessions {args.sessions} x {args.turns} turns, final live prefix {final} tokens each: "
          f"{live_pages} pages live, device pool {device_pages} pages ({live_pages / device_pages:.1f}x), "
          f"host tier {host_pages} pages; page {layout.page_bytes} B")

    def engine(host: bool) -> LLMEngine:
        return LLMEngine(model, EngineConfig(cache_bytes=device_pages * layout.page_bytes,
                                             host_cache_bytes=host_pages * layout.page_bytes if host else 0,
                                             max_num_batched_tokens=args.budget, max_model_len=final + 64))

    results = {False: [], True: []}
    for rep in range(args.repeats):
        for host in (False, True):
            e = engine(host)
            t0 = time.perf_counter()
            outputs, recomputed, ttft = chat(e, args, model.config.vocab_size)
            wall = time.perf_counter() - t0
            results[host].append((outputs, recomputed, statistics.mean(ttft), wall))
            extra = ""
            if host:
                s, moved = e.cache.host.stats, e.runner.transfer.bytes
                extra = (f", prefetches {s.prefetches}, host hits {s.hits} ({s.hit_tokens} tokens), written back {moved['write_back'] >> 10} KiB, "
                         f"prefetched {moved['prefetch'] >> 10} KiB in {e.runner.transfer.prefetch_seconds * 1e3:.1f} ms")
            print(f"repeat {rep} {'tier   ' if host else 'no tier'}: recomputed {recomputed} prefix tokens, "
                  f"returning TTFT mean {statistics.mean(ttft) * 1e3:.0f} ms, wall {wall:.1f} s, "
                  f"preemptions {e.scheduler.num_preemptions}{extra}")
    same = all(a[0] == b[0] for a, b in zip(results[False], results[True]))
    rec = [r[1] for r in results[False]], [r[1] for r in results[True]]
    ttft = statistics.median(r[2] for r in results[False]), statistics.median(r[2] for r in results[True])
    print(f"recomputed prefix tokens: {rec[0][0]} -> {rec[1][0]} ({1 - rec[1][0] / max(rec[0][0], 1):.0%} less); "
          f"returning TTFT (median of means) {ttft[0] * 1e3:.0f} -> {ttft[1] * 1e3:.0f} ms "
          f"({ttft[0] / ttft[1]:.2f}x); greedy outputs identical: {same}")


def run_admission(args) -> None:
    import torch

    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.sampling import SamplingParams

    model, layout = model_and_layout()
    full = args.prompt + args.new
    per_request = layout.mla_pages_for(full) + layout.pages_per_state
    pages = args.requests // 4 * per_request + layout.pages_per_state  # a quarter, and one checkpoint
    print(f"{args.requests} requests of {args.prompt} + {args.new} tokens ({per_request} pages each at the end) "
          f"over {pages} pages")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, model.config.vocab_size, (args.prompt,), generator=g).tolist()
               for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
    settings = [("fixed", 64)] + [("fixed", int(n)) for n in args.sweep.split(",")] + [("auto", 64)]
    rows = {s: [] for s in settings}
    reference = None
    for _ in range(args.repeats):
        for admission, seqs in settings:
            e = LLMEngine(model, EngineConfig(cache_bytes=pages * layout.page_bytes, max_num_seqs=seqs,
                                              max_num_batched_tokens=args.budget, admission=admission,
                                              enable_prefix_caching=False))
            t0, c0 = time.perf_counter(), time.process_time()
            steps = 0
            ids = [e.add_request(p, params).request_id for p in prompts]
            done = {rid: [] for rid in ids}
            while e.has_unfinished:
                for o in e.step():
                    done[o.request_id] += [t.token_id for t in o.new_tokens]
                steps += 1
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            out = [done[rid] for rid in ids]
            reference = reference or out
            tokens = args.requests * args.new
            rows[(admission, seqs)].append((tokens / wall, tokens / cpu, e.scheduler.num_preemptions, steps))
            print(f"{admission} max_num_seqs {seqs}: {tokens / wall:.1f} tok/s ({tokens / cpu:.1f} per CPU second), "
                  f"preemptions {e.scheduler.num_preemptions}, steps {steps}, same tokens {out == reference}",
                  flush=True)
    print("medians (tok/s, tok per CPU second):")
    for (admission, seqs), r in rows.items():
        print(f"  {admission:5} {seqs:3}: {statistics.median(x[0] for x in r):7.1f} {statistics.median(x[1] for x in r):7.1f}"
              f", preemptions {r[0][2]}, steps {r[0][3]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["tier", "admission"], required=True)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first", type=int, default=192, help="first prompt's tokens")
    ap.add_argument("--user", type=int, default=48, help="new tokens per later turn")
    ap.add_argument("--reply", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--host-factor", type=float, default=4.0, help="host tier pages / live prefix pages")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--sweep", default="3,4,6,8", help="fixed max_num_seqs values")
    args = ap.parse_args()
    print(configure(args.threads).describe())
    (run_tier if args.mode == "tier" else run_admission)(args)


if __name__ == "__main__":
    main()
