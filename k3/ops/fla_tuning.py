"""fla's Triton autotuning, recorded once on a Hopper card and replayed, so a cold process compiles
each fla kernel once instead of once per candidate config.

fla decorates its kernels with `triton.autotune`: the first call of a kernel with a new tuning key
(head count, head dims, block sizes, dtypes; not the sequence length) compiles and times every
candidate config, which made a cold `k3 train --device cuda` or GPU test run spend minutes before
its first step (docs/LOG.md, "Cold fla kernels"). `fla_tuning.json` beside this file holds the
winners the autotuner picked on an H100 for the shapes k3's verbs, tests and benches use; `seed()`
puts them into the autotuners' own caches, which Triton consults before tuning. A key that was
never recorded still autotunes as usual, and a recorded config that the installed fla no longer
offers is skipped, so a seeded process computes exactly what an unseeded one would, only sooner.

Seeding applies on compute capability 9.x (H100, H200), where the record was made; elsewhere, or
with `K3_FLA_AUTOTUNE=1`, fla tunes as it always did. `record(path)` writes the choices the
current process made, in the same format (bench/fla_tuning.py merges several into the file).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

TUNING_FILE = Path(__file__).with_name("fla_tuning.json")
DISABLE_ENV = "K3_FLA_AUTOTUNE"  # "1": autotune every key as fla does, ignore the record


def _is_autotuner(obj) -> bool:
    """Triton's Autotuner, told by what this module uses of it (so tests need no triton)."""
    return all(hasattr(obj, a) for a in ("configs", "cache", "base_fn")) and isinstance(obj.cache, dict)


def _autotuners():
    """(name, Autotuner) for every autotuned kernel in the loaded fla modules; name is
    module.function of the kernel, unique where the bare function name is not."""
    seen = set()
    for mod_name, mod in list(sys.modules.items()):
        if not (mod_name == "fla" or mod_name.startswith("fla.")) or mod is None:
            continue
        for obj in list(vars(mod).values()):
            fn, depth = obj, 0
            while fn is not None and depth < 4:  # heuristics and autotune wrap each other
                if _is_autotuner(fn) and id(fn) not in seen:
                    seen.add(id(fn))
                    base = fn.base_fn
                    yield f"{base.__module__}.{base.__name__}", fn
                fn, depth = getattr(fn, "fn", None), depth + 1


def _config_record(config) -> dict:
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
            "num_ctas": getattr(config, "num_ctas", 1), "maxnreg": getattr(config, "maxnreg", None)}


def _key_record(key: tuple) -> list:
    return [v if isinstance(v, (bool, int, float, str)) or v is None else str(v) for v in key]


def record(path: str | Path) -> int:
    """Write the tuning choices this process made ({kernel: [[key, config], ...]}); returns how many."""
    out, n = {}, 0
    for name, tuner in _autotuners():
        entries = [[_key_record(k), _config_record(c)] for k, c in tuner.cache.items()]
        if entries:
            out[name] = entries
            n += len(entries)
    Path(path).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    return n


def _wanted() -> bool:
    if os.environ.get(DISABLE_ENV, "") == "1":
        return False
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def seed(path: str | Path = TUNING_FILE, *, force: bool = False) -> int:
    """Put the recorded choices into the loaded fla autotuners' caches; returns how many were
    seeded (0 where seeding does not apply or no record exists). Keys already tuned stay."""
    if not (force or _wanted()):
        return 0
    try:
        table = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return 0
    n = 0
    for name, tuner in _autotuners():
        offered = {json.dumps(_config_record(c), sort_keys=True): c for c in tuner.configs}
        for key, config in table.get(name, ()):
            chosen = offered.get(json.dumps(config, sort_keys=True))
            key = tuple(key)
            if chosen is not None and key not in tuner.cache:
                tuner.cache[key] = chosen
                n += 1
    return n
