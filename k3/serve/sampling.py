"""Per-request sampling parameters and the batched sampler (tensor code, called by the runner).

Token selection is `k3.sampling.sample_next` (greedy rows in one batch, on the logits' device, as
the reference `generate` picks them; the others row by row), so greedy serving is the model's own
`generate` by construction; each request may bring its own seed (its own generator,
so its samples do not depend on what else is in the batch). Logprobs are of the model's raw
distribution (before temperature / top-k / top-p), as in the OpenAI API, unless the request asks
for `logprobs_mode="processed"`: then they are of softmax(z / T), the distribution its tokens are
drawn from before top-k / top-p truncation (what an RL trainer's importance ratio needs).

A request's own generator starts from its `seed`, or from a saved `generator_state` (a CPU
ByteTensor of `torch.Generator.get_state()`): a stream paused after some tokens resumes exactly
where it stopped. `Sampler.generator_state` reads a request's state after its last draw; the
engine returns it on the request's finished output and from `LLMEngine.abort`.

A row whose sampling raises (non-finite logits) gets a `SampledToken` with `error` set instead of
failing the batch: the engine finishes that request alone with finish reason "error".
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field

import torch

from k3.sampling import GREEDY_BELOW, check_sampling, sample_next

log = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20  # the OpenAI API's bound
# Stop strings are matched on every decoded chunk: bounding their number and length bounds the
# per-token cost of matching (the OpenAI API also allows at most 4).
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
# SamplingParams.logprobs_mode: "raw", the model's T = 1 distribution (the OpenAI API's logprobs);
# "processed", log softmax(z / T), the distribution sampled from before top-k / top-p truncation
LOGPROBS_MODES = ("raw", "processed")


def generator_seed(seed: int) -> int:
    """A request's seed as torch's CPU generator takes it. It keeps 32 bits, so 5 and 2**32 + 5 drew
    the same stream: seeds outside [0, 2**32) are hashed into that range instead (the API takes any
    64-bit integer); those inside it are used as they are."""
    if 0 <= seed < 2**32:
        return seed
    return int.from_bytes(hashlib.sha256(f"k3-seed|{seed}".encode()).digest()[:4], "big")


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings, matched on the decoded text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; n >= 0: the chosen token's logprob plus the top n
    # None: off; n >= 0: each prompt token's logprob (from the second on) plus the top n, as vLLM's
    # prompt_logprobs. Such a request never reads the prefix cache: a cached prefix has no logits.
    prompt_logprobs: int | None = None
    # what `logprobs` scores (LOGPROBS_MODES): "raw" (T = 1, the default) or "processed" (softmax(z / T),
    # before top-k / top-p; a greedy request's logits are divided by no temperature, so it reports raw ones)
    logprobs_mode: str = "raw"
    # the request's generator starts from this state (torch.Generator.get_state(), a CPU ByteTensor)
    # instead of from `seed`: a sampled stream resumes where it stopped (Sampler.generator_state)
    generator_state: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise ValueError(f"max_tokens must be >= 1 (0 only to score a prompt), got {self.max_tokens}")
        check_sampling(self.temperature, self.top_p, self.top_k)
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {n}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop accepts at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"each stop string must be at most {MAX_STOP_CHARS} characters")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if self.generator_state is not None:
            state = self.generator_state
            if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.device.type != "cpu":
                raise ValueError("generator_state must be a CPU uint8 tensor (torch.Generator.get_state())")
            try:
                torch.Generator().set_state(state)
            except RuntimeError as e:
                raise ValueError(f"generator_state is not a CPU generator's state: {e}") from None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW  # what sample_next treats as greedy

    @property
    def logprob_temperature(self) -> float:
        """What the logits are divided by before the log-softmax of `logprobs`: the temperature in
        "processed" mode (a sampling request), else 1."""
        return self.temperature if self.logprobs_mode == "processed" and not self.greedy else 1.0

    @property
    def own_generator(self) -> bool:
        """Whether the request draws from its own generator (a seed or a generator_state), not the
        sampler's shared one."""
        return self.seed is not None or self.generator_state is not None


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None  # (token id, logprob), best first
    error: str | None = None  # sampling failed for this row (token_id is then meaningless)


class Sampler:
    """Picks one token per row of logits [N, V] with each row's own parameters.

    The engine's sampler can be replaced (`LLMEngine(..., sampler=...)`: an instance, or a factory
    called with `EngineConfig.seed`); a subclass may override the public methods below, which are
    all the engine calls."""

    def __init__(self, seed: int | None = None):
        self._generator = torch.Generator()  # for requests without a seed or generator state
        if seed is not None:
            self._generator.manual_seed(seed)
        self._per_request: dict[str, torch.Generator] = {}

    def generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        """The generator a sampling request draws from: its own, created at its first draw from
        `params.generator_state` or else `params.seed`, or the shared one when it has neither."""
        if not params.own_generator:
            return self._generator
        gen = self._per_request.get(request_id)
        if gen is None:
            gen = torch.Generator()
            if params.generator_state is not None:
                gen.set_state(params.generator_state)
            else:
                gen.manual_seed(generator_seed(params.seed))
            self._per_request[request_id] = gen
        return gen

    def generator_state(self, request_id: str, params: SamplingParams) -> torch.Tensor | None:
        """The request's own generator state now, after its last draw (a CPU ByteTensor, a copy):
        the state it starts from if it has drawn nothing yet; None when it has no generator of its
        own (neither seed nor generator_state: it draws from the shared one). Passed back as
        `SamplingParams.generator_state`, it continues the stream."""
        gen = self._per_request.get(request_id)
        if gen is not None:
            return gen.get_state()
        if params.generator_state is not None:
            return params.generator_state.clone()
        if params.seed is not None:
            return torch.Generator().manual_seed(generator_seed(params.seed)).get_state()
        return None

    def forget(self, request_id: str) -> None:
        """The request finished: drop its generator."""
        self._per_request.pop(request_id, None)

    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> list[SampledToken]:
        """Greedy rows without logprobs (what most serving traffic asks for) take one batched argmax
        where the logits are, so only their token ids cross to the host; the other rows move to the
        host in fp32 and each takes its own generator (per-row argmax calls and the [N, V] copy cost
        more host time than a replayed decode step on GPU). Logprobs are one batched log-softmax
        of the rows, each divided by its `logprob_temperature` when some row is "processed"."""
        out: list[SampledToken | None] = [None] * len(params)
        plain = [n for n, p in enumerate(params) if p.greedy and p.logprobs is None]
        if plain:
            picked = logits if len(plain) == len(params) else logits[plain]
            for n, token in zip(plain, sample_next(picked, temperature=0.0).tolist()):
                out[n] = SampledToken(token)
        rest = [n for n, sampled in enumerate(out) if sampled is None]
        if not rest:
            return out
        host = logits[rest].float().cpu()
        logprobs = None
        if any(params[n].logprobs is not None for n in rest):
            scaled = host
            if any(params[n].logprobs_mode != "raw" for n in rest):  # x / 1 is x: raw rows are unchanged
                scaled = host / torch.tensor([params[n].logprob_temperature for n in rest],
                                             dtype=torch.float32)[:, None]
            logprobs = torch.log_softmax(scaled, dim=-1)
        for row, n in enumerate(rest):
            try:
                out[n] = self._sample_row(host[row:row + 1], None if logprobs is None else logprobs[row],
                                          request_ids[n], params[n])
            except Exception as e:  # noqa: BLE001 (this request fails alone; its batch-mates keep their tokens)
                log.warning("sampling failed for request %s: %r", request_ids[n], e)
                out[n] = SampledToken(-1, error=f"sampling failed: {e}")
        return out

    @staticmethod
    def score(logits: torch.Tensor, targets: list[int], top: list[int]) -> list[SampledToken]:
        """Prompt logprobs: row i of logits [S, V] scores token targets[i], with its top[i] best
        alternatives; log_softmax in fp32 of these rows only, one host copy. A row with non-finite
        logprobs (a model gone bad on this input) gets `error` set: its request fails alone."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = logprobs.gather(1, torch.tensor(targets, device=logits.device)[:, None])[:, 0]
        finite = (torch.isfinite(chosen) & torch.isfinite(logprobs.amax(-1))).cpu().tolist()
        chosen = chosen.cpu().tolist()
        k = max(top)
        best = torch.topk(logprobs, k) if k else None
        values, indices = (best.values.cpu().tolist(), best.indices.cpu().tolist()) if k else ([], [])
        return [SampledToken(t, lp, list(zip(indices[i][:n], values[i][:n])) if n else None,
                             error=None if finite[i] else "non-finite prompt logprobs")
                for i, (t, lp, n) in enumerate(zip(targets, chosen, top))]

    def _sample_row(self, logits: torch.Tensor, logprobs: torch.Tensor | None, rid: str,
                    p: SamplingParams) -> SampledToken:
        token = int(sample_next(logits, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                generator=None if p.greedy else self.generator(rid, p))[0])
        sampled = SampledToken(token)
        if p.logprobs is not None:
            sampled.logprob = float(logprobs[token])
            if p.logprobs:
                top = torch.topk(logprobs, p.logprobs)
                sampled.top_logprobs = list(zip(top.indices.tolist(), top.values.tolist()))
        return sampled
