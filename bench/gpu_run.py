"""One consolidated GPU run (issue #5): ceilings, then correctness checks, then benchmarks,
within a hard time budget, writing results as they come.

    python3 bench/gpu_run.py --out DIR [--smoke] [--budget-s 380] [--sections checks,bench:train]
                             [--triton-cache FOLDER]
    python3 bench/gpu_run.py --report DIR [--record docs/BENCHMARKS.md]   # re-render, append

Every section runs in its own process with its own timeout: a device-side assert, an OOM, a hung
compile or a segfault costs that section only, and the run as a whole ends within the budget
(measured from this script's start; JIT/autotuning and CUDA start-up included). Order: ceilings
(the benches need them), checks (they matter most), benches. A section's timeout is the smaller of
its cap and what the budget leaves after reserving every later section's minimum; inside, each
check or size is skipped (and recorded as skipped) when its own deadline would pass.

DIR receives records.jsonl (one JSON object per result, appended and flushed as it happens),
results.json (all records plus run metadata, rewritten after every section), summary.md (tables)
and logs/<section>.log (each section's full output). The short table printed last shows the
ceilings, every FAIL/ERROR, and the bench tables.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # bench.* and k3.* import from the checkout
from bench.serve_modes import K3_MODES, agreement_summary, mixed_line  # noqa: E402 (torch-free)


@dataclass(frozen=True)
class Section:
    name: str
    cap_s: float  # most seconds it may take on the GPU
    min_s: float  # fewest seconds worth starting it with


# Caps from the 2026-12-02 H200 run: fla's first chunk_kda call JIT-compiles and autotunes for
# minutes (120 s was too little for checks:kda, 75 s for bench:train); a warm Triton cache
# (--triton-cache) cuts that to seconds.
SECTIONS = [
    Section("ceilings", 45, 10),
    # compiles and autotunes fla's kernels (chunk bf16, packed, conv, qk-norm): 274 s in run 11, and
    # 300 s reached 22 of its 70 comparisons at a6d128e
    Section("checks:kda", 450, 30),
    # 63 s warm on 2026-12-03, plus ~85 s for the compiled model (run 13); the KDA-layer check last
    Section("checks:layers", 280, 20),
    Section("checks:moe", 40, 10),
    # the pytest files that need CUDA (bench/gpu_tests.py); cold, fla's backward kernels for the
    # test shapes took 270 s and more (runs 24-26)
    Section("tests:gpu", 420, 30),
    Section("bench:decode", 420, 25),  # 60 rows of ~2-20 s each, in order of importance (gpu_bench.py)
    # uniform workload (warm-up + measured round, 4 engines: ~200 s in run 17), then the mixed one
    # (HF alone took 30 s there)
    Section("bench:serve", 330, 40),
    # eager, then regional torch.compile: 195 s in run 15 reached only the eager row (probe, first-step
    # JIT, timing); compiling the regions adds ~50-100 s
    Section("bench:train", 330, 30),
    # the layers first (ours, then fla's), each at 4K/16K/64K; a cold compile of fla's layer did not
    # finish inside 240 s (run 31)
    Section("bench:kda", 420, 20),
    Section("bench:moe", 25, 10),
]
SMOKE_CAP_S = 600  # CPU smoke sizes are tiny but the machine is shared and slow
MARGIN_S = 5  # a child stops starting work this long before it would be killed


# ----------------------------------------------------------------------------- child side
def run_section(name: str, out: Path, smoke: bool, seconds: float) -> None:
    """Runs in the child process: one section, records appended to out/records.jsonl."""
    import torch

    deadline = time.monotonic() + seconds
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    records = out / "records.jsonl"

    def record(entry: dict) -> None:
        with open(records, "a") as f:
            f.write(json.dumps({"section": name, **entry}, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())

    kind, _, group = name.partition(":")
    if kind == "ceilings":
        from bench.ceilings import measure

        record({"kind": "meta", **_environment(device)})
        record({"kind": "ceiling", **measure(device, smoke)})
    elif kind == "checks":
        from bench.gpu_checks import run_group

        run_group(group, device, smoke, record, deadline)
    elif kind == "tests":
        from bench.gpu_tests import run_tests

        run_tests(record, deadline)
    else:
        from bench.gpu_bench import BENCHES

        BENCHES[group](device, smoke, _known(records), record, deadline)


def _environment(device) -> dict:
    import importlib.metadata
    import platform

    import torch

    def version(pkg: str) -> str | None:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None

    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "triton": version("triton"), "fla_core": version("fla-core"),
           "flash_linear_attention": version("flash-linear-attention")}
    try:
        env["commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["commit"] = None
    return env


def _known(records: Path) -> dict:
    """What the benches need from earlier sections: the measured ceilings (datasheet values if that
    section failed) and whether the grouped_mm experts check ran (a device-side assert there means
    the benches must not train through grouped_mm)."""
    from bench.ceilings import H200_BF16_DENSE_TFLOPS, H200_HBM_GBPS

    entries = _read(records)
    known = next((dict(e) for e in entries if e.get("kind") == "ceiling"), None) or {
        "matmul_bf16_tflops": H200_BF16_DENSE_TFLOPS, "copy_gbps": H200_HBM_GBPS, "note": "datasheet (not measured)"}
    moe = [e for e in entries if e.get("section") == "checks:moe"]
    status = next((e["status"] for e in moe if e.get("kind") == "section"), "skipped")
    experts_error = any(e.get("name") == "experts" and e.get("status") == "ERROR" for e in moe)
    # not run (budget): unknown, so try it; crashed or hung: assume grouped_mm did it
    known["grouped_mm_ok"] = status == "skipped" or (status == "ok" and not experts_error)
    return known


# ----------------------------------------------------------------------------- parent side
def run_all(out: Path, smoke: bool, budget_s: float, only: list[str] | None = None,
            triton_cache: Path | None = None) -> int:
    start = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    records = out / "records.jsonl"
    records.unlink(missing_ok=True)
    # One Triton cache for every section: kernels compiled and autotuned by the checks (fla caches
    # its autotuning results there too, FLA_CACHE_RESULTS) are reused by the benches in their own
    # processes, and by the next device call when it is carried back (--triton-cache).
    cache_dir = Path(os.environ.setdefault("TRITON_CACHE_DIR", str(Path("/tmp") / "k3-triton-cache")))
    if triton_cache is not None:
        print(f"triton cache: {restore_triton_cache(triton_cache, cache_dir)}", flush=True)
    # in the order --sections names them (groups expand in their listed order); all of them by default
    sections = SECTIONS if not only else list(dict.fromkeys(
        s for o in only for s in SECTIONS if s.name == o or s.name.startswith(o + ":")))
    if only and not sections:
        raise SystemExit(f"--sections {','.join(only)} names no section of {[s.name for s in SECTIONS]}")
    if sections[0].name != "ceilings":  # every run measures its own ceilings (~10 s): bounds need them
        sections = [SECTIONS[0]] + [s for s in sections if s.name != "ceilings"]
    for i, section in enumerate(sections):
        left = budget_s - (time.monotonic() - start)
        reserve = sum(s.min_s for s in sections[i + 1:])
        timeout = SMOKE_CAP_S if smoke else min(section.cap_s, left - reserve)
        if timeout < section.min_s:
            _append(records, {"section": section.name, "kind": "section", "status": "skipped",
                              "note": f"budget: {left:.0f}s left, {reserve:.0f}s reserved for later sections"})
            print(f"[{section.name}] skipped (budget)", flush=True)
            continue
        t0 = time.monotonic()
        cmd = [sys.executable, str(Path(__file__).resolve()), "--section", section.name, "--out", str(out),
               "--seconds", f"{timeout - MARGIN_S:.0f}"] + (["--smoke"] if smoke else [])
        log_path = out / "logs" / f"{section.name.replace(':', '_')}.log"
        with open(log_path, "w") as log:
            try:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, cwd=REPO).returncode
                status = "ok" if rc == 0 else f"exit {rc}"
            except subprocess.TimeoutExpired:
                status = f"killed at its {timeout:.0f}s timeout"
        seconds = time.monotonic() - t0
        tail = "" if status == "ok" else " | ".join(log_path.read_text(errors="replace").strip().splitlines()[-3:])[-400:]
        _append(records, {"section": section.name, "kind": "section", "status": status, "seconds": seconds,
                          "note": tail})
        entries = [e for e in _read(records) if e.get("section") == section.name and e.get("kind") in ("check", "bench")]
        bad = sum(e.get("status") in ("FAIL", "ERROR", "error") for e in entries)
        print(f"[{section.name}] {status} in {seconds:.0f}s (timeout {timeout:.0f}s): {len(entries)} results, "
              f"{bad} FAIL/ERROR" + (f"\n    log tail: {tail}" if tail else ""), flush=True)
        _write_results(out, budget_s, time.monotonic() - start)
    summary = render(_read(records))
    (out / "summary.md").write_text(summary)
    _write_results(out, budget_s, time.monotonic() - start)
    if not smoke:
        print(f"triton cache: {save_triton_cache(cache_dir, out)}", flush=True)
    print(short_table(_read(records)), flush=True)
    print(f"total {time.monotonic() - start:.0f}s of the {budget_s:.0f}s budget; full results in {out}", flush=True)
    return 0


TRITON_PART_BYTES = 15 * 2 ** 20  # the device tool brings back files of at most 16 MiB
TRITON_PART_PREFIX = "triton-cache.tar.xz."


def save_triton_cache(cache_dir: Path, out: Path) -> str:
    """Pack the Triton cache into out/triton-cache.tar.xz.NN parts (each under the size the device
    tool returns), so the next call starts with compiled kernels and autotuning results. xz at its
    default level on every core: Python's single-threaded level 1 made run 31's cache (591 MB) 53
    MiB, too big to carry beside the wheels (the device tool carries 64 MiB in all); level 6, 39 MiB
    (3 min on this 2-core CPU; on the device's 16 cores well under a minute is expected, not measured)."""
    if not cache_dir.is_dir():
        return "none to save"
    try:  # the run's results are written already; a cache that cannot be packed only costs the next run time
        tar = subprocess.run(["tar", "-C", str(cache_dir), "-cf", "-", "."], capture_output=True, check=True)
        data = subprocess.run(["xz", "-6", "-T0"], input=tar.stdout, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"not saved: {exc}"
    parts = [data[i:i + TRITON_PART_BYTES] for i in range(0, len(data), TRITON_PART_BYTES)]
    for n, part in enumerate(parts):
        (out / f"{TRITON_PART_PREFIX}{n:02d}").write_bytes(part)
    return f"saved {len(data) / 2 ** 20:.1f} MiB in {len(parts)} part(s)"


def restore_triton_cache(folder: Path, cache_dir: Path) -> str:
    import io
    import tarfile

    parts = sorted(folder.glob(TRITON_PART_PREFIX + "*"))
    if not parts:
        return f"no {TRITON_PART_PREFIX}* parts in {folder}: starting cold"
    data = b"".join(p.read_bytes() for p in parts)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:xz") as tar:
        tar.extractall(cache_dir, filter="data")
    return f"restored {len(data) / 2 ** 20:.1f} MiB from {len(parts)} part(s)"


def _append(path: Path, entry: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(entry, default=str) + "\n")


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    entries = []
    for line in path.read_text().splitlines():
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a killed child
            continue
    return entries


def _write_results(out: Path, budget_s: float, elapsed_s: float) -> None:
    entries = _read(out / "records.jsonl")
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps({"budget_s": budget_s, "elapsed_s": elapsed_s, "records": entries}, indent=1,
                              default=str))
    tmp.replace(out / "results.json")


# ----------------------------------------------------------------------------- rendering
def _fmt(x, spec: str = ".3g") -> str:
    if isinstance(x, int) and not isinstance(x, bool):
        return str(x)  # batch sizes, contexts: exact
    return format(x, spec) if isinstance(x, float) else str(x if x is not None else "")


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _bench_tables(entries: list[dict]) -> list[str]:
    out = []
    train = [e for e in entries if e.get("bench") == "train" and e.get("status") == "ok"]
    if train:
        out += ["### Training step (bf16 autocast, AdamW)", _table(
            ["config", "ms/step", "tokens/s", "TFLOP/s", "MFU (measured ceiling)", "MFU (989 datasheet)", "peak GB", "note"],
            [[e["name"], e["ms_per_step"], e["tokens_per_s"], e["tflops"], f"{e['mfu_measured_ceiling']:.1%}",
              f"{e['mfu_datasheet']:.1%}", e.get("peak_mem_gb"), e.get("note", "")] for e in train])]
    kda = [e for e in entries if e.get("bench") == "kda" and e.get("status") == "ok" and "ms_fwd_bwd" in e]
    if kda:
        out += ["### KDA vs attention, one layer / op, fwd+bwd, bf16, batch 1", _table(
            ["case", "ms", "TFLOP/s"], [[e["name"], e["ms_fwd_bwd"], e.get("tflops", "")] for e in kda])]
        ratios = [e for e in entries if e.get("bench") == "kda" and e.get("name", "").startswith(("ratio", "speed"))]
        for e in ratios:
            out.append(f"{e['name']}: " + ", ".join(f"{k} {v:.2f}x" for k, v in e.items()
                                                    if isinstance(v, float)))
        for e in entries:
            if e.get("bench") == "kda" and "usable" in e:
                out.append(f"{e['name']}: {e['usable']}")
    dec = [e for e in entries if e.get("bench") == "decode" and e.get("status") == "ok"]
    if dec:
        # the hybrid's advantage: its tokens/s over the all-MLA variant's, same batch, context, mode
        mla = {(e["batch"], e["context"], e.get("mode")): e["tokens_per_s"] for e in dec if e["variant"] == "all-MLA"}
        out += ["### Decode (bf16, absorbed MLA, one token per sequence per step)", _table(
            ["variant", "mode", "batch", "context", "ms/step", "tokens/s", "bandwidth-bound tokens/s",
             "fraction of bound", "hybrid / all-MLA"],
            [[e["variant"], e.get("mode", "eager"), e["batch"], e["context"], e["ms_per_step"], e["tokens_per_s"],
              e["bound_tokens_per_s"], f"{e['fraction_of_bound']:.1%}",
              f"{e['tokens_per_s'] / mla[key]:.2f}x" if e["variant"] == "hybrid" and (
                  key := (e["batch"], e["context"], e.get("mode"))) in mla else ""] for e in dec])]
    serve = [e for e in entries if e.get("bench") == "serve" and e.get("status") == "ok"
             and e.get("workload", "uniform") == "uniform"]
    if serve:
        rows = []
        for e in serve:
            for mode, (label, _, _) in K3_MODES.items():
                if f"k3_{mode}_tokens_per_s" in e:
                    rows.append([e["name"], e["dtype"], f"k3 engine, {label}", e["hf_tokens_per_s"], e[f"k3_{mode}_tokens_per_s"],
                                 f"{e[f'k3_{mode}_throughput_ratio']:.2f}x", e["hf_ttft_s"], e[f"k3_{mode}_ttft_s"],
                                 f"{e[f'k3_{mode}_agreement_with_hf']:.1%}"])
        out += ["### Serving engine vs HF transformers generate (greedy, same weights)", _table(
            ["workload", "dtype", "engine", "HF tokens/s", "k3 tokens/s", "k3 / HF", "HF TTFT s", "k3 TTFT s",
             "greedy agreement with HF"], rows)]
        out += [f"{e['name']}: prefill logits vs HF fp32 (same device): HF {e['dtype']} {e['hf_prefill_rel_err']:.2e}, "
                f"k3 {e['dtype']} {e['k3_prefill_rel_err']:.2e}"
                + agreement_summary(e) for e in serve]
        out += [mixed_line(e) for e in entries
                if e.get("bench") == "serve" and e.get("status") == "ok" and e.get("workload") == "mixed"]
    moe = [e for e in entries if e.get("bench") == "moe" and e.get("status") == "ok"]
    if moe:
        out += ["### Routed experts (bf16)", _table(["case", "ms", "TFLOP/s"],
                                                    [[e["name"], e["ms"], e["tflops"]] for e in moe])]
    return out


def render(entries: list[dict]) -> str:
    meta = next((e for e in entries if e.get("kind") == "meta"), {})
    ceil = next((e for e in entries if e.get("kind") == "ceiling"), None)
    checks = [e for e in entries if e.get("kind") == "check"]
    lines = [f"## GPU checks and benchmarks ({meta.get('date', '?')})", "",
             f"`python3 bench/gpu_run.py --out $OUT` on {meta.get('device', '?')}, torch {meta.get('torch')} "
             f"(CUDA {meta.get('cuda')}), triton {meta.get('triton')}, fla-core {meta.get('fla_core')}, "
             f"flash-linear-attention {meta.get('flash_linear_attention')}, commit {meta.get('commit')}.", ""]
    if ceil:
        lines += [f"Ceilings measured in this run: bf16 matmul {ceil['matmul_bf16_tflops']:.0f} TFLOP/s "
                  f"(n={ceil['matmul_n']}, median), device copy {ceil['copy_gbps']:.0f} GB/s (read+write); "
                  f"datasheet {ceil['datasheet_bf16_tflops']:.0f} TFLOP/s, {ceil['datasheet_hbm_gbps']:.0f} GB/s.", ""]
    counts = {s: sum(e.get("status") == s for e in checks) for s in ("PASS", "PASS(tf32)", "FAIL", "ERROR", "SKIP")}
    lines += ["### Checks (rel = RMSE(ref - out) / RMSE(ref))", " ".join(f"{k} {v}" for k, v in counts.items()), "",
              _table(["check", "rel", "bound", "status", "note"],
                     [[e["name"], e.get("rel", ""), e.get("bound", ""), e["status"], e.get("note", "")] for e in checks]),
              ""]
    for block in _bench_tables(entries):
        lines += [block, ""]
    problems = [e for e in entries if e.get("status") not in ("ok", "PASS", "PASS(tf32)")
                and e.get("kind") not in ("check", "meta", "ceiling")]
    if problems:
        lines += ["### Sections and benches not completed",
                  _table(["section", "name", "status", "note"],
                         [[e.get("section"), e.get("name", ""), e.get("status"), e.get("note", "")] for e in problems]), ""]
    return "\n".join(lines)


def short_table(entries: list[dict]) -> str:
    """What the device tool's 12k-character output tail should show: not every passing check."""
    checks = [e for e in entries if e.get("kind") == "check"]
    bad = [e for e in checks if e["status"] in ("FAIL", "ERROR")]
    lines = ["", "=" * 100]
    ceil = next((e for e in entries if e.get("kind") == "ceiling"), None)
    if ceil:
        lines.append(f"ceilings: bf16 matmul {ceil['matmul_bf16_tflops']:.0f} TFLOP/s, copy {ceil['copy_gbps']:.0f} GB/s")
    lines.append("checks: " + ", ".join(f"{s} {sum(e['status'] == s for e in checks)}"
                                        for s in ("PASS", "PASS(tf32)", "FAIL", "ERROR", "SKIP")))
    for e in bad:
        lines.append(f"  {e['status']:<5} {e['name']}  rel={_fmt(e.get('rel'))} bound={_fmt(e.get('bound'))} "
                     f"{str(e.get('note', ''))[:160]}")
    lines += _bench_tables(entries)
    for e in entries:
        if e.get("kind") == "section":
            seconds = f" {e['seconds']:.0f}s" if "seconds" in e else ""
            lines.append(f"section {e['section']}: {e['status']}{seconds}" + (f"  {e['note'][-200:]}" if e.get("note") else ""))
        elif e.get("kind") == "bench" and e.get("status") not in ("ok",):
            lines.append(f"  {e['status']}: {e['bench']} {e['name']}  {str(e.get('note', ''))[:120]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="results directory ($OUT on the device machine)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: verify every code path locally")
    parser.add_argument("--budget-s", type=float, default=380.0, help="hard wall-clock budget of the whole run")
    parser.add_argument("--sections", help="comma list of sections or groups to run, in that order "
                        "(e.g. checks,bench:train), after the ceilings, which every run measures; "
                        "default all, in the order of SECTIONS")
    parser.add_argument("--triton-cache", type=Path,
                        help="folder holding the triton-cache.tar.xz.NN parts an earlier run left in its --out")
    parser.add_argument("--report", type=Path, help="re-render DIR/summary.md from DIR/records.jsonl")
    parser.add_argument("--record", type=Path, help="with --report: append the summary to this markdown file")
    parser.add_argument("--section", help=argparse.SUPPRESS)  # internal: run one section (child process)
    parser.add_argument("--seconds", type=float, default=3600.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.section:
        run_section(args.section, args.out, args.smoke, args.seconds)
        return 0
    if args.report:
        summary = render(_read(args.report / "records.jsonl"))
        (args.report / "summary.md").write_text(summary)
        if args.record:
            with open(args.record, "a") as f:
                f.write("\n" + summary + "\n")
        print(summary)
        return 0
    if args.out is None:
        parser.error("--out DIR is required")
    only = [name.strip() for name in args.sections.split(",") if name.strip()] if args.sections else None
    return run_all(args.out, args.smoke, args.budget_s, only, args.triton_cache)


if __name__ == "__main__":
    sys.exit(main())
