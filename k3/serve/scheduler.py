"""Continuous batching over ids and token counts (vLLM v1 style; no tensors here).

Every step: running requests first, in admission order, each getting the tokens it still has to
compute, capped by the step's token budget (chunked prefill) and by its next KDA checkpoint
position (a checkpoint can only be saved where a step ends). When a running request needs pages
and none are free, the most recently admitted request is preempted: its pages are released and it
goes back to the front of the waiting queue with zero computed tokens, to be recomputed later
(outputs are kept, so the result is the same, never wrong). Waiting requests are admitted only
in a step without preemption, while there is budget and a slot, and, with an admission controller
(admission.py), while the pool's projected use leaves room for them. A request whose prefix hit is
being prefetched from the host tier (host_tier.py) waits in place; the ones behind it may go first.

A vision model's prefill chunks also share an encoder budget per step (vLLM's
`max_num_encoder_input_tokens`), counted in the placeholders of the images and video clips a
chunk starts to cover, the tower's new work: a chunk stops before the first image that would pass
it, except that each step may always start one image (progress), so a long image prompt cannot
stall the decoding requests of its step behind a wall of tower calls.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from k3.serve.admission import AdmissionController
from k3.serve.cache_manager import CacheManager, PagePlan
from k3.serve.request import Request, RequestStatus, fit_model_length
from k3.serve.sampling import SampledToken


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the API answers 429 with Retry-After."""


@dataclass
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens computed this step
    num_computed: int  # tokens already in the request's state (where these start)
    page_table: list[int]  # MLA pages, covering num_computed + len(token_ids) tokens
    state_pages: list[list[int]]  # private KDA state, per KDA layer
    sample: bool  # the chunk reaches the last known token: its logits pick the next token
    # prompt logprobs (sampling.prompt_logprobs): the logits of positions score_from, score_from + 1,
    # ... (inside this chunk) score the prompt tokens score_targets (each the token after its position)
    score_from: int = 0
    score_targets: list[int] = field(default_factory=list)
    # speculative decoding: room (pages, token budget) for this many drafted tokens after token_ids;
    # the runner drafts them and reports the tokens it kept
    num_draft: int = 0


@dataclass
class SchedulerOutput:
    requests: list[ScheduledRequest] = field(default_factory=list)
    plan: PagePlan = field(default_factory=PagePlan)
    preempted: list[str] = field(default_factory=list)
    # requests whose pages were freed since the previous output (finished, aborted, preempted): the
    # runner must not write their state back, their pages may belong to others now
    released: set[str] = field(default_factory=set)

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)


class Scheduler:
    def __init__(self, cache: CacheManager, *, max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                 max_model_len: int = 4096, max_waiting: int = 1024, num_speculative_tokens: int = 0,
                 max_num_encoder_tokens: int | None = None, admission: AdmissionController | None = None):
        """`admission`: the auto-throttling rule (None: admit while pages and slots last)."""
        if max_num_seqs < 1 or max_num_batched_tokens < 1 or max_waiting < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and max_waiting must be >= 1")
        if max_num_encoder_tokens is not None and max_num_encoder_tokens < 1:
            raise ValueError(f"max_num_encoder_tokens must be >= 1, got {max_num_encoder_tokens}")
        # image placeholders whose encoding a step may start (None: max_num_batched_tokens)
        self.max_num_encoder_tokens = max_num_encoder_tokens or max_num_batched_tokens
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = min(max_model_len, cache.max_tokens_per_request())
        if self.max_model_len < 2:
            raise ValueError(f"the page pool is too small to serve any request ({cache.pool.num_pages} pages)")
        self.max_waiting = max_waiting
        self.num_speculative_tokens = num_speculative_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.admission = admission
        self._released: set[str] = set()  # SchedulerOutput.released of the next output
        self._retained: set[str] = set()  # stopped requests whose state the cache adopted (`take_retained`)

    # ------------------------------------------------------------------ queue
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        fit_model_length(request.num_prompt_tokens, request.sampling.max_tokens, self.max_model_len)
        if len(self.waiting) >= self.max_waiting:
            raise QueueFullError(f"{len(self.waiting)} requests waiting (bound {self.max_waiting})")
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def finish(self, request_id: str, status: RequestStatus, *, retain: bool = False) -> Request | None:
        """Stop a request now (abort, stop string) and free its pages; None if unknown. `retain`:
        its state is sound (it did not fail), so the prefix cache may keep it where it stopped."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        else:
            self.running.remove(request)
        request.status = status
        if retain and self.cache.retain(request):
            self._retained.add(request_id)
        self.cache.free(request)
        self._released.add(request_id)
        return request

    def take_retained(self) -> set[str]:
        """The requests stopped since the last call whose KDA state the prefix cache adopted: the
        runner must write those states to their pages (they may live only in the decode slots)
        before the engine returns or schedules, so a cached page never changes after caching."""
        retained, self._retained = self._retained, set()
        return retained

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step
    def _chunk(self, request: Request, start: int, budget: int, enc: list[int] | None = None,
               admitting: bool = False) -> int:
        """Tokens of `request` to compute from `start`: within the step's token `budget`, up to its
        next KDA checkpoint, and (with `enc`, the step's encoder budget left, [n] updated in place)
        stopping before an image whose encoding would pass that budget."""
        n = min(request.num_tokens - start, budget)
        upcoming = [c for c in request.checkpoints if c > start]
        n = min(n, upcoming[0] - start) if upcoming else n
        if enc is None or not request.media:
            return n
        for span in request.media:
            # new tower work: an image whose placeholders this chunk reaches for the first time (the
            # one a prefix hit ends inside counts too: its cached part was never encoded here)
            if span.offset + span.length <= start or span.offset >= start + n:
                continue
            if span.offset < start and not admitting:
                continue  # an earlier chunk of this computation covered it
            if span.length > enc[0] and enc[0] < self.max_num_encoder_tokens:  # one image per step always fits
                return max(0, min(n, span.offset - start))
            enc[0] -= span.length
        return n

    def _drafts(self, request: Request, budget: int) -> int:
        """How many tokens a decoding request may draft this step: up to k, within its max_tokens,
        the model length and the step's budget; none while a KDA checkpoint is pending (one is
        saved only where a step's verified tokens end, which drafts make unknowable)."""
        if not self.num_speculative_tokens or request.num_tokens - request.num_computed_tokens != 1 \
                or request.checkpoints:
            return 0
        room = min(request.sampling.max_tokens - len(request.output_token_ids),
                   self.max_model_len - request.num_tokens, budget) - 1
        return max(0, min(self.num_speculative_tokens, room))

    def _scheduled(self, request: Request, n: int, out: SchedulerOutput, drafts: int = 0) -> None:
        start = request.num_computed_tokens
        if start + n in request.checkpoints:
            self.cache.plan_checkpoint(request, start + n, out.plan)
        scheduled = ScheduledRequest(
            request.request_id, request.all_token_ids[start:start + n], start,
            list(self.cache.page_table(request.request_id)), self.cache.state_pages(request.request_id),
            sample=start + n == request.num_tokens and request.sampling.max_tokens > 0, num_draft=drafts)
        if request.sampling.prompt_logprobs is not None:  # positions not scored yet (a recompute skips them)
            first, end = max(start, len(request.prompt_logprobs)), min(start + n, request.num_prompt_tokens - 1)
            scheduled.score_from, scheduled.score_targets = first, request.prompt_token_ids[first + 1:end + 1]
        out.requests.append(scheduled)

    def _preempt(self, request: Request) -> None:
        self.cache.free(request)
        self._released.add(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.checkpoints = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.cache.begin_step()
        budget = self.max_num_batched_tokens
        enc = [self.max_num_encoder_tokens]  # placeholders of images this step may start to encode
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = self._chunk(request, request.num_computed_tokens, budget, enc)
            if n == 0:  # its next image waits for a step with encoder budget
                i += 1
                continue
            drafts = self._drafts(request, budget)
            while not self.cache.grow(request, n + drafts):
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                self._scheduled(request, n, out, drafts)
                budget -= n + drafts
                i += 1
                continue
            break
        if self.admission is not None:
            self.admission.step(bool(out.preempted))
        if not out.preempted:
            self._admit(out, budget, enc)
        self.cache.end_step(out.plan)
        out.released, self._released = self._released, set()
        return out

    def _admit(self, out: SchedulerOutput, budget: int, enc: list[int]) -> None:
        """Admit waiting requests in order while the step has budget, a slot and pages (and the
        admission rule agrees); one whose hit is being prefetched is passed over this step."""
        growth = 0
        if self.admission is not None:
            growth = sum(self.cache.pages_to_grow(r, self._projected(r)) for r in self.running)
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[i]
            hit = self.cache.lookup(request)
            if hit.pending:
                i += 1
                continue
            if hit.wait_for_room:
                break
            request.checkpoints = self.cache.checkpoint_positions(request, hit, request.boundaries)
            n = self._chunk(request, hit.length, budget, enc, admitting=True)
            need = 0
            if self.admission is not None:
                need = self.cache.pages_to_admit(hit, max(hit.length + n, self._projected(request)))
            if n == 0 or (self.admission is not None and not self.admission.admits(
                    self.cache.pool.num_used, growth, need, len(self.running))) \
                    or not self.cache.admit(request, hit, n, out.plan):
                request.checkpoints = []
                break
            del self.waiting[i]
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._scheduled(request, n, out)
            budget -= n
            if self.admission is not None:
                self.admission.admitted += 1
                growth += self.cache.pages_to_grow(request, self._projected(request))

    def _projected(self, request: Request) -> int:
        """Tokens the admission rule expects `request` to reach."""
        return self.admission.projected_tokens(request.num_tokens,
                                               request.sampling.max_tokens - len(request.output_token_ids),
                                               self.max_model_len)

    def update(self, out: SchedulerOutput, sampled: dict[str, list[SampledToken]],
               scored: dict[str, list[SampledToken]] | None = None) -> list[Request]:
        """Account for a finished step (`sampled`: each sampling chunk's new tokens, one or with
        speculation several; `scored`: prompt logprobs of the step's score_targets); returns the
        requests that sampled (tokens, or an error that finished them alone) or finished scoring
        their prompt with max_tokens 0; some now finished. A request that stops inside its new
        tokens keeps those up to the stop: `sampled` is cut to what was appended."""
        changed = []
        for s in out.requests:
            request = self.requests[s.request_id]
            new = sampled.get(s.request_id, [])
            kept = [t.token_id for t in new[:-1]] if s.num_draft and new and new[0].error is None else []
            # a speculating request computed its last token and the drafts it kept (one per new
            # token): they join the tokens now, so the prefix cache can hash what was computed
            request.output_token_ids += kept
            request.num_computed_tokens += len(s.token_ids) + len(kept)
            self.cache.commit(request)
            request.checkpoints = [c for c in request.checkpoints if c > request.num_computed_tokens]
            if s.score_targets:
                entries = scored[s.request_id]
                failed = next((e.error for e in entries if e.error is not None), None)
                if failed is not None:  # this request fails alone, as when its sampling fails
                    request.error = failed
                    changed.append(request)
                    self.finish(request.request_id, RequestStatus.FINISHED_ERROR)
                    continue
                request.prompt_logprobs += entries
            if request.sampling.max_tokens == 0 and request.num_computed_tokens == request.num_tokens:
                changed.append(request)  # a prompt-only request: scored, nothing to sample
                self.finish(request.request_id, RequestStatus.FINISHED_LENGTH)
                continue
            if not s.sample:
                continue
            changed.append(request)
            if new[0].error is not None:
                request.error = new[0].error
                self.finish(request.request_id, RequestStatus.FINISHED_ERROR)
                continue
            del request.output_token_ids[len(request.output_token_ids) - len(kept):]  # appended again, checked
            for k, token in enumerate(t.token_id for t in new):
                request.output_token_ids.append(token)
                status = self._stop_status(request, token)
                if status is not None:
                    del new[k + 1:]
                    self.finish(request.request_id, status, retain=True)
                    break
        return changed

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        p = request.sampling
        if (token == request.eos_token_id and not p.ignore_eos) or token in p.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if len(request.output_token_ids) >= p.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
