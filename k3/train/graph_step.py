"""A whole training step captured as one CUDA graph and replayed (DESIGN §14.5).

A small model's eager step on a GPU is thousands of kernel launches of a few microseconds each:
the host, not the card, sets the pace (k3-tiny: ~130 ms a step for ~10 ms of kernels). Here the
step's forward, backward, gradient clipping, optimizer update and expert-balance update are
recorded once and replayed with one launch. What makes that possible:

- fixed shapes: a step's micro-batches are copied into static buffers of a fixed token count,
  and each packed row's `cu_seqlens` is padded with zero-length documents to a fixed count (the
  row's bucket: the next power of two >= its documents, so a handful of graphs serve a run); a
  row is any dataclass of tensors (`k3 rl` adds its per-token tensors, k3/rl/objective.py), and
  its padded shapes pick the graph, with its other fields: host metadata the step was recorded for
  (the VL images' grids, k3/train/vl_trainer.py), hashable;
- no host reads inside the step: the ops' host-free paths (k3/ops/host_free.py), a capturable
  optimizer whose learning rate is a device tensor the schedule fills between replays
  (k3/train/muon.py), a sync-free balance update (k3/train/balance.py);
- autocast without its weight-cast cache (a cast cached at capture would be replayed stale);
- the loss, gradient norm and expert loads stay on the device: the trainer reads them back
  every few steps, so the host packs the next step while the card runs this one.

A bucket's first step runs eagerly in host-free mode (it warms kernels, autotuning and the
allocator: a real step, not a throwaway), its second is captured and replayed. The eager
step, the capture and the replays compute the same numbers (tests/train/test_graph_step_gpu.py).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from k3.ops.host_free import host_free
from k3.train.packing import IGNORE_INDEX, PackedBatch

MIN_DOC_BUCKET = 8
MAX_GRAPHS = 16  # buckets captured per run; steps of further buckets run eagerly (host-free, same numbers)


def doc_bucket(docs: int) -> int:
    """The padded document count of a row with `docs` documents: a power of two >= MIN_DOC_BUCKET."""
    return max(MIN_DOC_BUCKET, 1 << max(0, docs - 1).bit_length())


def token_bucket(tokens: int) -> int:
    """The fixed row length for a micro-batch of `tokens`: the next multiple of an eighth of the
    next power of two (at most 12.5% padding; eight lengths per doubling)."""
    step = max(1, (1 << max(0, tokens - 1).bit_length()) // 8)
    return -(-tokens // step) * step


def windowed(batch: PackedBatch, segment: int) -> bool:
    """Whether every multiple of `segment` inside the row starts a document (no document crosses one)."""
    starts = set(batch.cu_seqlens.tolist())
    return all(m in starts for m in range(segment, batch.input_ids.shape[1], segment))


def pad_batch(batch: PackedBatch, tokens: int, docs: int, pad_id: int) -> PackedBatch:
    """`batch` ([1, n] with d documents) as a row of exactly `tokens` tokens and `docs` documents:
    the pad tokens (if any) form one more document whose labels are ignored, then zero-length
    documents fill `cu_seqlens` up to `docs + 1` entries."""
    n = batch.input_ids.shape[1]
    cu = batch.cu_seqlens
    if n > tokens:
        raise ValueError(f"a micro-batch of {n} tokens does not fit the step's {tokens}")
    ids, labels = batch.input_ids, batch.labels
    if n < tokens:
        ids = torch.cat([ids, ids.new_full((1, tokens - n), pad_id)], 1)
        labels = torch.cat([labels, labels.new_full((1, tokens - n), IGNORE_INDEX)], 1)
        cu = torch.cat([cu, cu.new_tensor([tokens])])
    if cu.numel() - 1 > docs:
        raise ValueError(f"a micro-batch of {cu.numel() - 1} documents does not fit the bucket of {docs}")
    cu = torch.cat([cu, cu.new_full((docs + 1 - cu.numel(),), tokens)])
    return PackedBatch(ids, labels, cu)


@dataclasses.dataclass
class StepOutputs:
    """What a step leaves on the device (0-d tensors, overwritten by the next replay): summed NLL
    over its targets, the gradient norm before clipping, the largest expert load over its mean."""
    nll: torch.Tensor
    grad_norm: torch.Tensor
    max_load: torch.Tensor


class _Graph:
    """One bucket's static inputs (buffers shaped like the step's padded rows) and its captured step."""

    def __init__(self, batches: list, device: torch.device, scale: float | tuple[float, ...]):
        self.inputs = [dataclasses.replace(b, **{f: torch.zeros_like(t, device=device) for f, t in _tensors(b)})
                       for b in batches]
        self.scale = torch.zeros(() if isinstance(scale, float | int) else (len(scale),), device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs = None
        self.warm = False

    def load(self, batches: list, scale: float | tuple[float, ...]) -> None:
        for static, b in zip(self.inputs, batches):
            for (_, dst), (_, src) in zip(_tensors(static), _tensors(b)):
                pinned = src.pin_memory() if src.device.type == "cpu" and dst.is_cuda else src
                dst.copy_(pinned, non_blocking=True)
        if self.scale.dim():
            src = torch.tensor(scale, dtype=self.scale.dtype)
            self.scale.copy_(src.pin_memory() if self.scale.is_cuda else src, non_blocking=True)
        else:
            self.scale.fill_(scale)


def _tensors(batch) -> list[tuple[str, torch.Tensor]]:
    """A row's tensor fields (a dataclass: PackedBatch, k3.rl.objective.RLBatch), in field order."""
    return [(f.name, t) for f in dataclasses.fields(batch) if isinstance(t := getattr(batch, f.name), torch.Tensor)]


def _host_fields(batch) -> tuple:
    """A row's other fields (host metadata the step is recorded for): part of its graph's key."""
    return tuple((f.name, v) for f in dataclasses.fields(batch)
                 if not isinstance(v := getattr(batch, f.name), torch.Tensor))


def padded_docs(batches: list[PackedBatch], tokens: int) -> int:
    """The document bucket of `batches` padded to rows of `tokens` (pad tokens are one more document)."""
    return doc_bucket(max(b.cu_seqlens.numel() - 1 + (b.input_ids.shape[1] < tokens) for b in batches))


class GraphStep:
    """Replays captured training steps; `body(batches, scale)` is the step to capture: forward and
    backward of each micro-batch (`scale`: a device scalar the body reads, the loss's scale or its
    denominator; a tuple of floats: a device vector of them), then the update; it returns device
    tensors (train: a StepOutputs). `zero_grad()` sets every gradient to None (before an eager step
    or a capture: a captured backward must allocate its gradients, not add to earlier ones).
    `capture=False`: never capture, run every step eagerly (the tests' reference)."""

    def __init__(self, body: Callable[[list, torch.Tensor], object],
                 zero_grad: Callable[[], None], *, device: torch.device, pad_id: int, capture: bool = True,
                 log=print):
        self.body, self.zero_grad, self.device, self.pad_id, self.log = body, zero_grad, device, pad_id, log
        self.graphs: dict[tuple, _Graph] = {}
        # off CUDA, or with capture=False (the tests' reference), every step runs the same body
        # eagerly in host-free mode, with the same padding
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" and capture else None
        self.capture_error: str | None = None  # set by a failed capture: no more captures this run

    def step(self, batches: list[PackedBatch], scale: float, tokens: int | None = None,
             segment: int | None = None) -> StepOutputs:
        """Run one step over `batches` (packed rows on the host); `tokens`: the fixed row length
        (default: the longest row); `segment`: rows are whole windows of this many tokens (checked
        here: attention then runs window by window). Returns device tensors, valid until the next step."""
        tokens = max(b.input_ids.shape[1] for b in batches) if tokens is None else tokens
        docs = padded_docs(batches, tokens)
        if segment is not None and not all(windowed(b, segment) for b in batches):
            segment = None
        return self.run([pad_batch(b, tokens, docs, self.pad_id) for b in batches], scale, segment)

    def run(self, batches: list, scale: float | tuple[float, ...], segment: int | None = None):
        """Run one step over rows already padded to one shape (dataclasses of tensors with `input_ids`
        [1, T] and `cu_seqlens`, every row the same shapes: their shapes pick the graph). Returns
        what the body returns, valid until the next step."""
        shapes = [tuple(tuple(t.shape) for _, t in _tensors(b)) for b in batches]
        if len(set(shapes)) != 1:
            raise ValueError(f"a captured step's rows must have one shape, got {sorted(set(shapes))}")
        scales = None if isinstance(scale, float | int) else len(scale)
        key = (len(batches), shapes[0], scales, tuple(_host_fields(b) for b in batches), segment)
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = _Graph(batches, self.device, scale)
        g.load(batches, scale)
        if g.graph is not None:
            g.graph.replay()
            return g.outputs
        captured = sum(other.graph is not None for other in self.graphs.values())
        if self.stream is None or self.capture_error is not None or (g.warm and captured >= MAX_GRAPHS):
            with host_free(segment):
                self.zero_grad()
                return self.body(g.inputs, g.scale)
        # the bucket's first step runs eagerly, the second is captured: both on a side stream,
        # where capture wants its warm-up (lazy cuBLAS/allocator state stays off the main stream)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream), host_free(segment):
            self.zero_grad()
            if not g.warm:
                out = self.body(g.inputs, g.scale)
                g.warm = True
            else:
                try:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, stream=self.stream):
                        g.outputs = self.body(g.inputs, g.scale)
                    g.graph = graph
                    tokens, docs = batches[0].input_ids.shape[1], batches[0].cu_seqlens.numel() - 1
                    self.log(f"cuda graphs: captured a step of {len(batches)} x {tokens} tokens, "
                             f"<= {docs} documents a row")
                except (RuntimeError, AssertionError, ValueError) as e:  # nothing ran: now eagerly, and later steps
                    self.capture_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                    self.log(f"cuda graphs: capture failed ({self.capture_error}); steps run eagerly")
                    self.zero_grad()
                    out = self.body(g.inputs, g.scale)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        if g.graph is not None:
            g.graph.replay()
            return g.outputs
        return out
