"""RL drives the serving engine through its public API only: no module of k3/rl reaches
into the engine's insides (its runner, the sampler's private hooks, any private attribute of an
engine or a sampler, private names of k3.serve), so engine refactors cannot silently break the
rollout's guarantees. The log-prob mode, the generator state in and out, `abort`'s return and the
sampler injection are the extension points it may use (tests/serve/test_engine_extension_points.py)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import k3.rl

RL_DIR = Path(k3.rl.__file__).parent

# what reaching into the engine looks like in source
PRIVATE_ACCESS = {
    "the engine's runner": re.compile(r"\.runner\b"),
    "the sampler's per-row hook": re.compile(r"\._sample_row\b"),
    "a private engine attribute": re.compile(r"\bengine\._\w+"),
    "a private sampler attribute": re.compile(r"\bsampler\._\w+"),
    "the runner module": re.compile(r"\bk3\.serve\.runner\b"),
    "a private name of k3.serve": re.compile(r"from k3\.serve[\w.]* import [^\n]*\b_\w+"),
}


def private_accesses(source: str) -> list[tuple[int, str, str]]:
    return [(n, what, line.strip()) for n, line in enumerate(source.splitlines(), 1)
            for what, pattern in PRIVATE_ACCESS.items() if pattern.search(line)]


@pytest.mark.parametrize("line", [
    "        engine.runner.sampler = _RolloutSampler(self.engine_config.seed)",
    "        return self.engine.runner.sampler",
    "        sampled = super()._sample_row(logits, logprobs, rid, p)",
    "        self.engine._aborts.clear()",
    "        state = sampler._per_request[rid].get_state()",
    "from k3.serve.runner import ModelRunner",
    "from k3.serve.sampling import SamplingParams, _hidden",
])
def test_the_patterns_catch_private_access(line):
    assert private_accesses(line)


def test_the_patterns_let_public_use_through():
    assert not private_accesses("engine.abort(rid)\nstats = engine.cache.stats\nself._run(resume, new)\n"
                                "from k3.serve.sampling import SamplingParams\nengine.sampler")


def test_rl_uses_only_the_public_engine_api():
    sources = sorted(RL_DIR.glob("*.py"))
    assert any(p.name == "rollout.py" for p in sources)
    found = [f"{p.name}:{n}: {what}: {line}" for p in sources for n, what, line in private_accesses(p.read_text())]
    assert not found, "k3/rl reaches into the serving engine:\n" + "\n".join(found)
