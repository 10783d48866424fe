"""The engine: a step loop over scheduler -> runner -> scheduler, and its asyncio front.

`LLMEngine` is synchronous and thread-safe: `add_request` / `abort` may come from any thread;
`step` runs the scheduler under a lock, the forward without it, then the bookkeeping under it
again, so a request can be added while the model computes. Aborts are queued and applied at the
start of the next step (never while the runner is using the request's pages); called between
steps, `abort` also returns the request's state as it ends (`AbortedRequest`: its tokens and
generator state).

Extension points for in-process users (RL rollouts, k3/rl/rollout.py): per request, the log-prob
mode (`SamplingParams.logprobs_mode`) and a generator state to start from
(`SamplingParams.generator_state`), whose state after the last sampled token comes back on the
finished output (`RequestOutput.generator_state`) and from `abort`; per engine, the sampler
(`LLMEngine(..., sampler=...)`).

A request with `prompt_logprobs` runs the same steps: the runner scores its prompt positions
chunk by chunk, the scheduler collects the scores on the request, and they leave with its first
output (`RequestOutput.prompt_logprobs`); with max_tokens 0 it finishes once its prompt is computed.

`AsyncEngine` runs `step` on one background thread and hands each request's outputs to its
asyncio consumer; when the consumer goes away (client disconnect, cancellation) the request is
aborted and its pages are freed.

A forward that raises fails only the requests of that step (their pages are freed, their streams
get an `EngineError`); the loop goes on. A request whose sampling fails finishes alone (reason
"error"; its stream gets an `EngineError`) and is no step failure. Only repeated forward failures
in a row, or an error in the engine's own bookkeeping, stop the engine (`AsyncEngine.error`; the
API then answers 503): no request parameter can do that, since sampling is numerically safe for
every accepted value and isolated per request.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from k3 import threads
from k3.model.multimodal import placeholder_count
from k3.ops.batch_invariant import batch_invariant, check_device
from k3.regional_compile import compile_regions
from k3.serve.admission import AdmissionController
from k3.serve.cache_manager import CacheManager
from k3.serve.detokenizer import IncrementalDetokenizer, TextView
from k3.serve.page_layout import PageLayout
from k3.serve.request import MediaSpan, Request, RequestStatus
from k3.serve.runner import ModelRunner
from k3.serve.sampling import SampledToken, Sampler, SamplingParams
from k3.serve.scheduler import Scheduler
from k3.serve.speculator import Speculator

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine failed while serving a request (or has stopped)."""


class StepError(RuntimeError):
    """A step's forward raised: its requests (`request_ids`) are finished and their pages freed;
    `outputs` are the step's other outputs (aborts applied before the forward)."""

    def __init__(self, request_ids: list[str], outputs: list[RequestOutput]):
        super().__init__(f"engine step failed for {len(request_ids)} request(s)")
        self.request_ids, self.outputs = request_ids, outputs


@dataclass
class EngineConfig:
    block_size: int = 16  # tokens per MLA page (physical block)
    hash_block_size: int = 64  # prefix-hash granularity, independent of the page
    cache_bytes: int = 64 << 20  # size of the page pool
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 256  # per-step token budget (chunked prefill)
    # per-step budget of image placeholders whose encoding a step may start (None: max_num_batched_tokens)
    max_num_encoder_tokens: int | None = None
    max_model_len: int = 4096
    max_waiting: int = 256  # bounded queue: beyond it, requests are refused (HTTP 429)
    enable_prefix_caching: bool = True
    cuda_graphs: bool = True  # replay lasting decode batches from CUDA graphs (CUDA + grouped_mm experts only)
    # with cuda_graphs: packed (prefill / mixed) steps on static buckets, captured per shape
    # (k3/serve/packed_graph.py). Off until its GPU tests have run (checked on CPU only)
    packed_graphs: bool = False
    # torch.compile backend for each layer's norms, mixer, FFN and AttnRes reads (k3.regional_compile),
    # or None; "inductor" fuses the small kernels of a decode step (the first steps of each shape
    # compile). Decode steps only: packed (prefill) steps run the regions eagerly, since their shapes
    # change every step and compiling them raised TTFT (docs/LOG.md "Serving engine")
    compile: str | None = None
    # each mixer's projections of its input as one GEMM (k3.model.fusion): fewer launches per step,
    # parameters and memory unchanged; applied before compile and CUDA-graph capture
    fuse_projections: bool = True
    seed: int | None = None
    # speculative decoding with a draft (LLMEngine's `draft`): tokens drafted per sequence and step
    num_speculative_tokens: int = 0
    # every token computed with the same arithmetic whatever the batch, chunking or speculation
    # (k3.ops.batch_invariant; CPU only, slower): outputs reproducible bit for bit
    batch_invariant: bool = False
    # the prefix cache's host-memory tier (k3/serve/host_tier.py): bytes of host pages, 0 for none
    host_cache_bytes: int = 0
    # admission (k3/serve/admission.py): "auto" throttles by projected pool use, "fixed" admits
    # while pages and max_num_seqs last (preempting when running requests outgrow the pool)
    admission: str = "auto"
    admission_target_usage: float = 0.95
    admission_output_ratio: float = 0.7  # SGLang's new_token_ratio schedule: 0.7 down to 0.1 over 600 steps
    admission_min_output_ratio: float = 0.1
    admission_ratio_decay: float = 0.001


MAX_SPECULATIVE_TOKENS = 16


@dataclass
class ImageInput:
    """One image of a prompt, processed (k3.media.image_processor): its patches and grid, where its
    placeholder run starts in the prompt, and a hash of its pixels (the prefix-cache key)."""
    offset: int
    pixel_values: torch.Tensor  # [L, 3, P, P]
    grid_thw: tuple[int, int, int]
    digest: bytes


@dataclass
class RequestOutput:
    request_id: str
    new_tokens: list[SampledToken]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    error: str | None = None  # set when finish_reason is "error"
    # with the request's first output, when it asked for prompt logprobs: entry k scores prompt token k + 1
    prompt_logprobs: list[SampledToken] | None = None
    # on the finished output of a request with its own generator (a seed or a generator_state): its
    # state after the last sampled token (Sampler.generator_state); pass it back to continue the stream
    generator_state: torch.Tensor | None = None


@dataclass
class AbortedRequest:
    """A request as `LLMEngine.abort` leaves it (no token is sampled between the call and the abort)."""
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # the tokens sampled so far, each already returned by a step
    # its generator after the last of them (Sampler.generator_state); None without a seed or a state
    generator_state: torch.Tensor | None


SamplerFactory = Callable[[int | None], Sampler]  # called with EngineConfig.seed


class LLMEngine:
    def __init__(self, model, config: EngineConfig | None = None, draft=None, *,
                 sampler: Sampler | SamplerFactory | None = None):
        """`model`: a K3ForCausalLM, or a K3ForConditionalGeneration whose prompts may hold images
        (`add_request(images=...)`; the engine runs its language model and the runner its vision
        encoder). `draft`: an `EagleDraft` for the model (k3.checkpoint.draft_folder.load_draft
        checks that it is): with config.num_speculative_tokens >= 1 every decoding sequence drafts
        that many tokens per step and the model verifies them (k3.serve.speculator). `sampler`: the
        token sampler, a `Sampler` (or subclass) instance or a factory called with config.seed;
        default `Sampler(config.seed)`."""
        self.config = config = config or EngineConfig()
        if sampler is not None and not isinstance(sampler, Sampler):
            if not callable(sampler):
                raise TypeError(f"sampler must be a Sampler or a factory of one, got {type(sampler).__name__}")
            sampler = sampler(config.seed)
            if not isinstance(sampler, Sampler):
                raise TypeError(f"the sampler factory returned a {type(sampler).__name__}, not a Sampler")
        self.vision = model.eval() if hasattr(model, "language_model") else None
        if self.vision is not None:
            model = model.language_model
        self.model = model.eval()
        k = config.num_speculative_tokens
        if (draft is None) != (k == 0):
            raise ValueError("speculative decoding needs both a draft and num_speculative_tokens >= 1"
                             if draft is None or k else "a draft was given but num_speculative_tokens is 0")
        if not 0 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k}")
        if config.batch_invariant:
            check_device(next(model.parameters()).device)
            if config.compile:  # compiled kernels bypass the op-level mode
                raise ValueError("batch_invariant and compile exclude each other")
        fuse = getattr(model, "fuse_projections", None)  # a K3ForCausalLM's; test stand-ins have none
        if config.fuse_projections and fuse is not None:  # before compile and capture, which trace the fused GEMMs
            log.info("fused input projections: %s", "; ".join(fuse()) or "none")
        if config.compile:
            compile_regions(model, backend=config.compile)
        dtype = next(model.parameters()).dtype
        self.layout = PageLayout.from_config(model.config, config.block_size, dtype)
        speculator = None if draft is None else Speculator(model, draft, k)
        # speculation's memory, taken from the pool's budget: per running sequence, the draft's
        # state and the replay inputs of its k + 1 verified tokens in every KDA layer (DESIGN §11)
        self.speculation_bytes = 0 if draft is None else config.max_num_seqs * (
            speculator.state_bytes() + (k + 1) * self.layout.replay_bytes_per_token)
        num_pages = max(config.cache_bytes - self.speculation_bytes, 0) // self.layout.page_bytes
        if config.host_cache_bytes < 0:
            raise ValueError(f"host_cache_bytes must be >= 0, got {config.host_cache_bytes}")
        host_pages = config.host_cache_bytes // self.layout.page_bytes if config.enable_prefix_caching else 0
        self.cache = CacheManager(self.layout, num_pages, hash_block_size=config.hash_block_size,
                                  enable_prefix_caching=config.enable_prefix_caching, host_pages=host_pages)
        if config.admission not in ("auto", "fixed"):
            raise ValueError(f"admission must be 'auto' or 'fixed', got {config.admission!r}")
        admission = None if config.admission == "fixed" else AdmissionController(
            num_pages, config.admission_target_usage, config.admission_output_ratio,
            config.admission_min_output_ratio, config.admission_ratio_decay)
        self.scheduler = Scheduler(self.cache, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_model_len=min(config.max_model_len, model.config.max_position_embeddings),
                                   max_waiting=config.max_waiting, num_speculative_tokens=k,
                                   max_num_encoder_tokens=config.max_num_encoder_tokens, admission=admission)
        self.runner = ModelRunner(model, self.layout, num_pages, seed=config.seed, cuda_graphs=config.cuda_graphs,
                                  speculator=speculator, vision=self.vision, sampler=sampler,
                                  num_host_pages=host_pages, eager_packed=bool(config.compile),
                                  packed_graphs=config.packed_graphs)
        self.eos_token_id = model.config.eos_token_id
        # reentrant: abort() may run from a finalizer (gc) on any thread, even the engine thread
        # while it holds the lock (it then reads nothing mid-step: `_stepping`)
        self._lock = threading.RLock()
        self._stepping = False  # a step is under way (its forward runs without the lock)
        # a deque: the abort itself is queued and applied by the next step, whichever thread asks
        self._aborts: deque[tuple[str, RequestStatus]] = deque()
        self._ids = itertools.count()
        log.info("engine: %d pages of %d bytes (%d tokens each; KDA state %d pages), hash block %d, prefix cache %s, "
                 "host tier %d pages, admission %s", num_pages, self.layout.page_bytes, config.block_size,
                 self.layout.pages_per_state, config.hash_block_size,
                 "on" if config.enable_prefix_caching else "off", host_pages, config.admission)
        if draft is not None:
            log.info("speculative decoding: %d draft tokens per step; %.1f MB of the pool for draft states and "
                     "replay inputs (%d sequences)", k, self.speculation_bytes / 2**20, config.max_num_seqs)

    @property
    def max_model_len(self) -> int:
        """The most tokens a request may hold, prompt and output (`fit_model_length` checks a request)."""
        return self.scheduler.max_model_len

    @property
    def media_placeholder_token_id(self) -> int | None:
        """The id that stands in a prompt for each merged row of an image; None: no vision tower."""
        return None if self.vision is None else self.vision.config.media_placeholder_token_id

    @property
    def sampler(self) -> Sampler:
        """The engine's token sampler (the `sampler` given, or a `Sampler(config.seed)`)."""
        return self.runner.sampler

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, *, request_id: str | None = None,
                    boundaries: tuple[int, ...] = (), eos_token_id: int | None = None,
                    images: list[ImageInput] = ()) -> Request:
        """Queue a request; raises ValueError (bad input) or QueueFullError. `images`: the
        prompt's images, each over its run of placeholder ids (a vision model only)."""
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        spans = self._media_spans(prompt_token_ids, images)
        request = Request(request_id or f"req-{next(self._ids)}", list(prompt_token_ids), params,
                          eos_token_id=self.eos_token_id if eos_token_id is None else eos_token_id,
                          boundaries=tuple(boundaries), media=spans)
        with self._lock:
            if images:
                self.runner.add_media(request.request_id, spans, torch.cat([i.pixel_values for i in images]),
                                      torch.tensor([i.grid_thw for i in images]))
            try:
                self.scheduler.add_request(request)
            except BaseException:
                self.runner.forget(request.request_id)
                raise
        return request

    def _media_spans(self, prompt: list[int], images: list[ImageInput]) -> tuple[MediaSpan, ...]:
        """Each image's placeholder run, checked against the prompt (one placeholder per merged row)."""
        if self.vision is None:
            if images:
                raise ValueError("this model takes no images (it has no vision tower)")
            return ()
        token = self.media_placeholder_token_id
        kernel = tuple(self.vision.config.vision_config.merge_kernel_size)
        spans = []
        for n, image in enumerate(images):
            length = placeholder_count(image.grid_thw, kernel)
            run = prompt[image.offset:image.offset + length]
            if len(run) != length or any(t != token for t in run):
                raise ValueError(f"image {n} needs {length} placeholder tokens (id {token}) at prompt position "
                                 f"{image.offset}")
            spans.append(MediaSpan(image.offset, length, image.digest))
        if prompt.count(token) != sum(s.length for s in spans):
            raise ValueError(f"the prompt has {prompt.count(token)} image placeholder tokens, its images fill "
                             f"{sum(s.length for s in spans)}")
        return tuple(spans)

    def abort(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> AbortedRequest | None:
        """Stop a request: queued, applied at the start of the next step, whose outputs include the
        request's finished one (finish reason `status.value`, its `generator_state` set). Called
        between steps (from the thread that steps the engine, or while no step runs), returns the
        request's final state: no token is sampled before the abort applies. None when the
        request is unknown or finished, or when a step is under way (it may still sample for the
        request: the finished output then carries the final state)."""
        self._aborts.append((request_id, status))
        with self._lock:
            if self._stepping:
                return None
            request = self.scheduler.requests.get(request_id)
            if request is None:
                return None
            return AbortedRequest(request_id, list(request.prompt_token_ids), list(request.output_token_ids),
                                  self.runner.sampler.generator_state(request_id, request.sampling))

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._aborts)

    def step(self) -> list[RequestOutput]:
        threads.adapt()  # yield CPU threads to other processes' load (k3/threads.py)
        try:
            return self._step()
        finally:
            self._stepping = False

    def _step(self) -> list[RequestOutput]:
        outputs = []
        with self._lock:
            self._stepping = True
            while self._aborts:
                rid, status = self._aborts.popleft()
                request = self.scheduler.finish(rid, status, retain=True)  # between steps: its state is sound
                if request is not None:
                    outputs.append(self._output(request, []))
            self.runner.write_retained(self.scheduler.take_retained())
            out = self.scheduler.schedule()
            params = {r.request_id: self.scheduler.requests[r.request_id].sampling for r in out.requests}
        try:
            with batch_invariant(self.config.batch_invariant):
                result = self.runner.execute(out, params)
        except Exception as e:  # fail this step's requests only; the scheduler state stays consistent
            with self._lock:
                failed = []
                for r in out.requests:
                    request = self.scheduler.finish(r.request_id, RequestStatus.FINISHED_ABORTED)
                    if request is not None:
                        self.runner.forget(request.request_id)
                    failed.append(r.request_id)
            raise StepError(failed, outputs) from e
        with self._lock:
            for request in self.scheduler.update(out, result.sampled, result.scored):
                # None: a prompt-only request finished, or its prompt's scores failed
                new = result.sampled.get(request.request_id) if request.error is None else None
                outputs.append(self._output(request, [] if not new or new[0].error is not None else new))
            self.runner.write_retained(self.scheduler.take_retained())
            if not self.scheduler.has_unfinished:  # idle: the decode slots hold no running request
                self.runner.release_held_requests()
        return outputs

    def _output(self, request: Request, new: list[SampledToken]) -> RequestOutput:
        state = None
        if request.status.finished:
            if request.sampling.own_generator:
                state = self.runner.sampler.generator_state(request.request_id, request.sampling)
            self.runner.forget(request.request_id)
        first = len(request.output_token_ids) == len(new)
        prompt = request.prompt_logprobs if first and request.sampling.prompt_logprobs is not None else None
        return RequestOutput(request.request_id, new, request.status.finished, request.finish_reason,
                             request.num_prompt_tokens, request.num_cached_tokens or 0,
                             len(request.output_token_ids), request.error, prompt, state)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion (a convenience for tests, benchmarks and the terminal chat)."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp).request_id for p, sp in zip(prompts, params)]
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        pending = set(ids)
        while pending:
            for o in self.step():
                if o.request_id in tokens:
                    tokens[o.request_id] += [t.token_id for t in o.new_tokens]
                    if o.finished:
                        pending.discard(o.request_id)
        return [tokens[rid] for rid in ids]


@dataclass
class StreamDelta:
    text: str
    token_ids: list[int]
    tokens: list[SampledToken]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    prompt_logprobs: list[SampledToken] | None = None  # in the first delta, when the request asked


class AsyncEngine:
    """One background thread steps the engine; each request streams deltas to an asyncio queue."""

    def __init__(self, engine: LLMEngine, tokenizer: Tokenizer):
        self.engine = engine
        self.tokenizer = tokenizer
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    @property
    def max_model_len(self) -> int:
        """The most tokens a request may hold, prompt and output (the engine's)."""
        return self.engine.max_model_len

    @property
    def media_placeholder_token_id(self) -> int | None:
        """The engine's image placeholder id; None: a text-only model."""
        return self.engine.media_placeholder_token_id

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="k3-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    max_consecutive_step_failures = 3  # then the model is taken to be broken: the engine stops

    def _loop(self) -> None:
        failures = 0
        while not self._stop.is_set():
            if not self.engine.has_unfinished:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
                failures = 0
            except StepError as e:
                failures += 1
                log.error("engine step failed (%d in a row); failing %d request(s)", failures, len(e.request_ids),
                          exc_info=e.__cause__)
                broken = failures >= self.max_consecutive_step_failures
                if broken:  # set before any client hears of this step, so its next request sees a 503
                    self.error = e.__cause__ or e
                for rid in e.request_ids:
                    self._emit(rid, EngineError(f"the model failed while serving this request: {e.__cause__!r}"))
                self._deliver(e.outputs)
                if broken:
                    self._fail(self.error)
                    return
                continue
            except BaseException as e:  # bookkeeping broke: every waiting client must hear, not hang
                log.exception("engine loop failed")
                self._fail(e)
                return
            self._deliver(outputs)

    def _emit(self, rid: str, item) -> None:
        target = self._queues.get(rid)
        if target is not None:
            loop, queue = target
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            self._emit(o.request_id, o)

    def _fail(self, e: BaseException) -> None:
        self.error = e
        for rid in list(self._queues):
            self._emit(rid, EngineError(f"the engine stopped after an error: {e!r}"))

    def _release(self, rid: str, abort: bool) -> None:
        self._queues.pop(rid, None)
        if abort:
            self.engine.abort(rid)
            self._wake.set()

    def generate(self, prompt_token_ids: list[int], params: SamplingParams, *, request_id: str | None = None,
                 boundaries: tuple[int, ...] = (), eos_token_id: int | None = None, images: list[ImageInput] = (),
                 skip_special_tokens: bool = True, on_finish: Callable[[str], None] | None = None,
                 text_view: TextView | None = None) -> RequestStream:
        """Add a request NOW (raising ValueError / QueueFullError / EngineError before anything is
        streamed, so the caller can still answer with a status code) and return its stream of
        deltas. Closing the stream before the end (aclose / close, even before the first
        iteration; cancellation; garbage collection) aborts the request and frees its pages.
        `on_finish(reason)` is called once when the stream closes: its finish reason, "error" or
        "cancelled" (closed before the end). `text_view` replaces the detokenizer (and its
        matching of `params.stop`): the chat route's parsed reply, whose stop strings see only
        the content."""
        if self.error is not None:
            raise EngineError(f"the engine stopped after an error: {self.error!r}")
        rid = request_id or f"req-{uuid.uuid4().hex}"
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = (asyncio.get_running_loop(), queue)  # before the engine can emit anything
        try:
            self.engine.add_request(prompt_token_ids, params, request_id=rid, boundaries=boundaries,
                                    eos_token_id=eos_token_id, images=images)
        except BaseException:
            del self._queues[rid]
            raise
        if self.error is not None:  # the loop died between the check above and our queue entry
            self._release(rid, abort=True)
            raise EngineError(f"the engine stopped after an error: {self.error!r}")
        self._wake.set()
        view = text_view or IncrementalDetokenizer(self.tokenizer, params.stop, skip_special_tokens)
        return RequestStream(self, rid, queue, view, on_finish)


class RequestStream:
    """One request's deltas (an async iterator). `close()` / `aclose()` abort the request unless it
    has finished, whether or not iteration ever started; a stream dropped unclosed is aborted when
    it is garbage collected."""

    def __init__(self, engine: AsyncEngine, rid: str, queue: asyncio.Queue, detok: TextView,
                 on_finish: Callable[[str], None] | None = None):
        self.request_id = rid
        self._engine, self._queue, self._detok = engine, queue, detok
        self._on_finish = on_finish
        self.finished = False
        self.finish_reason: str | None = None  # "error" when the engine failed the request
        self._closed = False
        self._gen = self._iterate()

    def __aiter__(self) -> RequestStream:
        return self

    def __anext__(self):
        return self._gen.__anext__()

    def close(self) -> None:
        """Synchronous and idempotent: drop the queue entry, abort the request if unfinished."""
        if self._closed:
            return
        self._closed = True
        self._engine._release(self.request_id, abort=not self.finished)
        if self._on_finish is not None:
            self._on_finish(self.finish_reason or "cancelled")

    async def aclose(self) -> None:
        try:
            await self._gen.aclose()
        finally:
            self.close()

    def __del__(self):
        if not getattr(self, "_closed", True):
            self.close()

    async def _iterate(self) -> AsyncIterator[StreamDelta]:
        rid, engine, detok = self.request_id, self._engine.engine, self._detok
        try:
            while not self.finished:
                o = await self._queue.get()
                if isinstance(o, BaseException):  # the engine already finished the request
                    self.finished, self.finish_reason = True, RequestStatus.FINISHED_ERROR.value
                    if isinstance(o, EngineError):
                        raise o
                    raise EngineError(repr(o)) from o
                if o.finish_reason == RequestStatus.FINISHED_ERROR.value:
                    self.finished, self.finish_reason = True, o.finish_reason
                    raise EngineError(f"this request failed: {o.error}")
                ids = [t.token_id for t in o.new_tokens]
                text = detok.push(ids)
                finished, reason = o.finished, o.finish_reason
                if detok.stopped:  # a stop string: end here, free the pages now
                    if not finished:
                        engine.abort(rid, RequestStatus.FINISHED_STOPPED)
                        self._engine._wake.set()
                    finished, reason = True, RequestStatus.FINISHED_STOPPED.value
                elif finished:
                    text += detok.flush()
                self.finished = finished
                if finished:
                    self.finish_reason = reason
                yield StreamDelta(text, ids, o.new_tokens, finished, reason, o.num_prompt_tokens,
                                  o.num_cached_tokens, o.num_output_tokens, o.prompt_logprobs)
        finally:
            self.close()
