"""A serving request as the scheduler sees it: token ids, counts and a status (no tensors).

A request advances by one rule (vLLM v1): each step computes some of the tokens it knows but has
not computed yet (`num_tokens - num_computed_tokens`); prefill, chunked prefill, decode and
recompute after preemption are all that rule with different counts. `fit_model_length` is the one
check that a prompt and its max_tokens fit the model length (the API, the scheduler, `k3 chat`).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from k3.serve.sampling import SampledToken, SamplingParams


class ContextLengthError(ValueError):
    """A prompt, with the tokens it asks for, that does not fit the model length. `prompt_fills`: the
    prompt alone leaves no room for a token (the API blames the prompt, else max_tokens)."""

    def __init__(self, message: str, *, prompt_fills: bool):
        super().__init__(message)
        self.prompt_fills = prompt_fills


def fit_model_length(prompt_len: int, max_tokens: int | None, max_model_len: int) -> int:
    """The one "prompt + max_tokens fits the model" check (the API, the scheduler, `k3 chat`): the
    max_tokens a request of `prompt_len` tokens runs with, `max_tokens` itself or, when None, all the
    room the model length leaves. Raises ContextLengthError when the prompt leaves no room (unless
    max_tokens is 0: a prompt only scored may fill the model) or prompt + max_tokens exceeds it."""
    room = max_model_len - prompt_len
    if room < 1 and max_tokens != 0:
        raise ContextLengthError(f"the prompt ({prompt_len} tokens) fills the model length ({max_model_len})",
                                 prompt_fills=True)
    if max_tokens is not None and max_tokens > room:
        raise ContextLengthError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the model length "
                                 f"({max_model_len})", prompt_fills=False)
    return room if max_tokens is None else max_tokens


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"  # eos, a stop token or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the model length
    FINISHED_ABORTED = "abort"  # cancelled by the client
    FINISHED_ERROR = "error"  # this request's sampling failed (its batch-mates go on)

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


@dataclass(frozen=True)
class MediaSpan:
    """An image's placeholder run in a prompt: its pixels enter the model there (DESIGN §7)."""
    offset: int  # prompt position of the first placeholder
    length: int  # placeholders: the image's merged rows
    digest: bytes  # a hash of its tower input (k3.serve.api.images.media_digest)

    def hash_ids(self) -> list[int]:
        """Stand-ins for the placeholders in prefix-cache keys: negative (no token id is), one per
        position, derived from the pixels, so two images never share a key and the same one does."""
        base = int.from_bytes(self.digest[:8], "little") >> 1
        return [-1 - (base ^ j) for j in range(self.length)]


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_id: int | None = None
    # token positions inside the prompt where a chat turn starts: KDA checkpoint candidates
    boundaries: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    block_hashes: list[bytes] = field(default_factory=list)  # chained keys of the full hash blocks
    checkpoints: list[int] = field(default_factory=list)  # pending KDA checkpoint positions
    num_cached_tokens: int | None = None  # prefix-cache hit of the first admission
    num_preemptions: int = 0
    error: str | None = None  # why the request finished with FINISHED_ERROR
    # sampling.prompt_logprobs requests: entry k scores prompt token k + 1 (from position k's logits);
    # kept across a preemption, so a recompute scores only the positions not scored yet
    prompt_logprobs: list[SampledToken] = field(default_factory=list)
    media: tuple[MediaSpan, ...] = ()  # images, in prompt order

    def __post_init__(self):
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: the prompt has no tokens")
        end = 0
        for span in self.media:
            if span.offset < end or span.length < 1 or span.offset + span.length > len(self.prompt_token_ids):
                raise ValueError(f"request {self.request_id}: image placeholder runs must be ordered, disjoint "
                                 "and inside the prompt")
            end = span.offset + span.length

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def hash_token_ids(self) -> list[int]:
        """What the prefix cache keys on: the token ids, with each image's placeholders replaced by
        stand-ins derived from its pixels (the ids alone are the same for every image of a size)."""
        if not self.media:
            return self.all_token_ids
        ids = self.all_token_ids
        for span in self.media:
            ids[span.offset:span.offset + span.length] = span.hash_ids()
        return ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
