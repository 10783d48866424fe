"""RL rollouts through the serving engine, in process, with partial rollout (DESIGN §13.2, §13.4).

`Rollouts(model, engine_config)` drives one `k3.serve.engine.LLMEngine` over the trainer's own
model object (so rollouts see exactly the trainer's weights, QAT included: DESIGN §13.4, "rollout
and training use the same quantization scheme"). `run(prompts, K)` samples K completions of each
prompt (a group) and returns `Trajectory` records: prompt and completion ids, the behaviour
policy's log-prob of every sampled token, the policy version that sampled it, and the finish
reason.

Group prefix sharing. The K requests of a group share their prompt: the first (the leader) is
submitted alone, and its K - 1 followers once its prompt has been computed, so they find the KDA
checkpoint the engine saves at the prompt's end (DESIGN §11) and compute only the last prompt token
(`Segment.cached_tokens` and `RolloutBatch.prefix_hits` show it).

Behaviour log-probs. The policy is pi_T = softmax(z / T): the model's logits z at the sampling
temperature T, before any top-k / top-p truncation. Each recorded log-prob is log pi_T(token) from
the very fp32 logits the engine sampled from, and `k3.rl.objective.token_logprobs(model, batch,
temperature=T)` recomputes the same quantity in the trainer, so the importance ratio compares like
with like (the engine's default `logprobs` are of the raw T = 1 distribution, as in the OpenAI API;
rollout requests ask for `SamplingParams(logprobs=0, logprobs_mode="processed")`, the engine's
log-prob of the distribution it samples from). With top_p < 1 or top_k > 0 the tokens are drawn
from a truncated pi_T that the ratio does not see: RL normally keeps top_p = 1, top_k = 0.

Seeding. A trajectory owns one random stream: a torch.Generator seeded from (run seed, group,
sample) (`trajectory_seed`) that draws its tokens one after another. Each engine request starts
its generator from a state (`SamplingParams.generator_state`: the seeded one, or the saved one),
and the engine returns the state after its last sampled token on the finished output
(`RequestOutput.generator_state`). When partial rollout pauses (aborts) a trajectory, that state
travels with it (`Trajectory.rng_state`) and the resumed request continues from it, not from the
seed again. The rollout uses the engine's public API only (tests/rl/test_rollout_api.py checks
that it reaches into no private engine attribute). So "the same seed"
means the same token stream whatever the pauses: at fixed weights, with batch-invariant arithmetic
(`EngineConfig.batch_invariant`), a trajectory split over any number of iterations is bit for bit
the one sampled without a pause; and with stop_fraction 1 nothing is ever paused, so the result is
the synchronous rollout's.

Partial rollout (DESIGN §13.2, after Kimi K1.5): `run(prompts, K, stop_fraction=lam, resume=...)`
submits the resumed trajectories first, then the new groups, and once ceil(lam * (resumed + N * K))
trajectories have finished it aborts the rest; each unfinished one is returned with its tokens,
log-probs, per-token versions and generator state, and the next `run(..., resume=unfinished)`
re-submits prompt + partial completion as a new request that keeps sampling. Its prefix-cache
hit reaches the latest KDA checkpoint on its path (a hybrid model resumes nowhere else, DESIGN §11):
the one the engine kept where the aborted request stopped (its last sampled token is computed
again), or if the pool evicted it, an earlier one (the prompt end at worst) and the tokens since
are recomputed by chunked prefill. Every trajectory comes back exactly once from each `run`
it enters, finished or not; a `run` that raises leaves the engine empty but its trajectories
half-updated (restart the iteration from saved copies).

Policy versions. In process, the trainer updates the model's weights in place between `run`
calls and bumps `policy_version`; every token records the version current when it was sampled.
The prefix cache is kept across versions by default (a resumed prefix is not recomputed: the
tokens' recorded log-probs are what was sampled, so the ratio stays the correct importance
weight); `reset_cache()` drops it for strictly fresh prefixes.
"""
from __future__ import annotations

import hashlib
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from k3.quant.qat import reused_weight_quantization
from k3.sampling import GREEDY_BELOW
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams
from k3.serve.scheduler import QueueFullError


class RolloutError(RuntimeError):
    """A rollout request failed in the engine (e.g. non-finite logits)."""


@dataclass(frozen=True)
class Prompt:
    """A prompt's token ids, its chat-turn boundaries (KDA checkpoint candidates, XTML's
    `Rendered.boundaries`) and anything the caller wants back on its trajectories (`tag`)."""
    token_ids: tuple[int, ...]
    boundaries: tuple[int, ...] = ()
    tag: Any = None

    @classmethod
    def of(cls, prompt) -> Prompt:
        """A Prompt from a Prompt, a list of token ids, or anything with `token_ids` (and optionally
        `boundaries`), such as XTML's `Rendered`."""
        if isinstance(prompt, Prompt):
            return prompt
        if hasattr(prompt, "token_ids"):
            return cls(tuple(prompt.token_ids), tuple(getattr(prompt, "boundaries", ())))
        return cls(tuple(int(t) for t in prompt))


@dataclass
class Segment:
    """One engine request of a trajectory: its first, or a resumption after a pause."""
    prompt_tokens: int  # tokens submitted as the request's prompt (prompt + completion so far)
    cached_tokens: int  # of those, reused from the prefix cache
    new_tokens: int  # tokens it sampled
    version: int  # the policy version that sampled them


@dataclass(eq=False)  # identity: two trajectories are never "equal", and rng_state is a tensor
class Trajectory:
    uid: str  # "<seed>/<group>/<sample>": the same through every pause and resumption
    group_id: str  # "<seed>/<group>": the K trajectories of one prompt share it
    group: int  # index of the prompt in the `run` call that created the trajectory
    sample: int  # index within the group
    prompt_ids: list[int]
    seed: int
    max_tokens: int  # completion budget, over all segments
    boundaries: tuple[int, ...] = ()
    tag: Any = None
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # behaviour log pi_T(token), one per completion token
    versions: list[int] = field(default_factory=list)  # policy version that sampled each completion token
    finish_reason: str | None = None  # "stop" (a stop token, kept) or "length"; None while unfinished
    rng_state: torch.Tensor | None = None  # the generator after the last sampled token (set when paused)
    segments: list[Segment] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.completion_ids)


@dataclass
class RolloutBatch:
    finished: list[Trajectory]
    unfinished: list[Trajectory]  # pass back as `resume=` to the next run
    steps: int  # engine steps
    seconds: float
    new_tokens: int  # tokens sampled in this run
    prefix_queries: int  # admissions that looked the prefix cache up
    prefix_hits: int  # of those, admissions that reused a cached prefix
    prefix_hit_tokens: int


def trajectory_seed(seed: int, group: int, sample: int) -> int:
    """The seed of one trajectory's generator: a hash of (run seed, group, sample), 63 bits, so
    streams of different trajectories never coincide by arithmetic accident."""
    digest = hashlib.blake2b(f"k3-rl/{seed}/{group}/{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def initial_rng_state(seed: int) -> torch.Tensor:
    """The state a trajectory's generator starts from: a torch.Generator seeded with `seed`."""
    return torch.Generator().manual_seed(seed).get_state()


class Rollouts:
    """Groups of K sampled completions per prompt through one in-process LLMEngine."""

    def __init__(self, model, engine_config: EngineConfig | None = None, *, xtml=None, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, max_tokens: int = 256,
                 stop_token_ids: Sequence[int] | None = None):
        """`xtml`: a k3.text.xtml.XTML; its stop ids (`<|end_of_msg|>`, eos) end a reply unless
        `stop_token_ids` is given. Without either, the model's eos ends a reply."""
        if temperature < GREEDY_BELOW:
            raise ValueError(f"rollouts sample: temperature must be > 0, got {temperature}")
        self.engine_config = engine_config or EngineConfig()
        if self.engine_config.num_speculative_tokens:
            raise ValueError("rollouts draw each trajectory's tokens from one generator stream; speculative decoding "
                             "is not supported")
        self.model = model
        self.params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
        if stop_token_ids is None:
            stop_token_ids = list(xtml.stop_ids) if xtml is not None else [model.config.eos_token_id]
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        self.policy_version = 0  # the trainer bumps it after each weight update
        self.engine = self._new_engine()

    def _new_engine(self) -> LLMEngine:
        training = self.model.training
        engine = LLMEngine(self.model, self.engine_config)  # sets eval mode; the trainer's mode is restored
        self.model.train(training)
        return engine

    def reset_cache(self) -> None:
        """Drop the prefix cache (a fresh engine over the same model): later prefixes are computed
        by the current weights only."""
        if self.engine.has_unfinished:
            raise RuntimeError("reset_cache while requests are in flight")
        self.engine = self._new_engine()

    def new_trajectories(self, prompts: Sequence, K: int, seed: int) -> list[Trajectory]:
        """The N * K trajectories of `run(prompts, K, seed=seed)`, none sampled yet, group by group."""
        if K < 1:
            raise ValueError(f"K (samples per prompt) must be >= 1, got {K}")
        out = []
        for g, prompt in enumerate(prompts):
            p = Prompt.of(prompt)
            if not p.token_ids:
                raise ValueError(f"prompt {g} has no tokens")
            for k in range(K):
                out.append(Trajectory(f"{seed}/{g}/{k}", f"{seed}/{g}", g, k, list(p.token_ids),
                                      trajectory_seed(seed, g, k), self.params.max_tokens, p.boundaries, p.tag))
        return out

    def run(self, prompts: Sequence, K: int, *, stop_fraction: float = 1.0, resume: Sequence[Trajectory] = (),
            seed: int = 0) -> RolloutBatch:
        """Sample K completions of each prompt (token ids, `Prompt`s or XTML `Rendered`s), after
        resuming `resume`, until ceil(stop_fraction * (resumed + N * K)) trajectories have finished
        (with no new prompts, until all resumed ones have); the rest come back
        unfinished. `seed` names this call's trajectories: use a new one per iteration."""
        if not 0.0 < stop_fraction <= 1.0:
            raise ValueError(f"stop_fraction must be in (0, 1], got {stop_fraction}")
        if self.engine.has_unfinished:
            raise RuntimeError("the rollout engine has requests in flight (a previous run was interrupted)")
        for t in resume:
            if t.finished or t.remaining < 1:
                raise ValueError(f"trajectory {t.uid} is finished; only unfinished ones resume")
        new = self.new_trajectories(prompts, K, seed)
        everything = list(resume) + new
        if len({t.uid for t in everything}) != len(everything):
            raise ValueError("duplicate trajectory uids: resume each unfinished trajectory once, and give "
                             "each run a new seed")
        target = min(len(everything), math.ceil(stop_fraction * len(everything))) if new else len(everything)
        training = self.model.training
        self.model.eval()
        try:
            with reused_weight_quantization(self.model):  # QAT: quantize the weights once per run
                return self._run(list(resume), new, K, target)
        finally:
            self.model.train(training)

    def _run(self, resume: list[Trajectory], new: list[Trajectory], K: int, target: int) -> RolloutBatch:
        engine = self.engine
        stats = engine.cache.stats
        queries, hits, hit_tokens = stats.queries, stats.hits, stats.hit_tokens
        start = time.perf_counter()
        # resumed trajectories first (DESIGN §13.2), then each group's leader; followers wait for it
        backlog: deque[Trajectory] = deque(resume + new[::K])
        followers = {new[i].uid: new[i + 1:i + K] for i in range(0, len(new), K)}
        active: dict[str, Trajectory] = {}  # request id -> trajectory
        finished: list[Trajectory] = []
        stopping = False
        steps = new_tokens = 0

        def submit() -> None:
            while backlog and not stopping:
                t = backlog[0]
                rid = f"{t.uid}#{len(t.segments)}"
                # log pi_T of each sampled token; the stream continues from the saved state, else the seed's
                state = t.rng_state if t.rng_state is not None else initial_rng_state(t.seed)
                params = SamplingParams(max_tokens=t.remaining, temperature=self.params.temperature,
                                        top_p=self.params.top_p, top_k=self.params.top_k, seed=t.seed,
                                        stop_token_ids=self.stop_token_ids, logprobs=0, logprobs_mode="processed",
                                        generator_state=state)
                try:
                    engine.add_request(t.prompt_ids + t.completion_ids, params, request_id=rid,
                                       boundaries=t.boundaries, eos_token_id=-1)
                except QueueFullError:
                    return  # the rest wait for room
                backlog.popleft()
                active[rid] = t
                t.segments.append(Segment(len(t.prompt_ids) + len(t.completion_ids), 0, 0, self.policy_version))

        submit()
        try:
            while active:
                for o in engine.step():
                    t = active.get(o.request_id)
                    if t is None:
                        continue
                    segment = t.segments[-1]
                    segment.cached_tokens = o.num_cached_tokens
                    for token in o.new_tokens:
                        t.completion_ids.append(token.token_id)
                        t.logprobs.append(token.logprob)
                        t.versions.append(self.policy_version)
                    segment.new_tokens += len(o.new_tokens)
                    new_tokens += len(o.new_tokens)
                    if o.finish_reason == "error":
                        raise RolloutError(f"rollout {t.uid} failed in the engine: {o.error}")
                    if (o.new_tokens or o.finished) and t.uid in followers:  # the leader's prompt is computed
                        backlog.extend(followers.pop(t.uid))
                    if not o.finished:
                        continue
                    del active[o.request_id]
                    if o.finish_reason == "abort":  # paused: keep where its stream stands
                        t.rng_state = o.generator_state
                    else:
                        t.finish_reason, t.rng_state = o.finish_reason, None
                        finished.append(t)
                steps += 1
                if not stopping and len(finished) >= target:
                    stopping = True
                    for rid in active:
                        engine.abort(rid)
                submit()
        except BaseException:
            for rid in active:  # leave the engine empty, so the next run can start
                engine.abort(rid)
            while engine.has_unfinished:
                engine.step()
            raise
        done = {t.uid for t in finished}
        unfinished = [t for t in resume + new if t.uid not in done]
        return RolloutBatch(finished, unfinished, steps, time.perf_counter() - start, new_tokens,
                            stats.queries - queries, stats.hits - hits, stats.hit_tokens - hit_tokens)
