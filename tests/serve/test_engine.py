"""The engine with the real k3-tiny model (4 of its layers) at random init: greedy outputs equal
the model's own `generate` for any prefix-cache setting, batch composition and chunked-prefill
size, with decode steps continuing on the decode slots without refilling them; requests leaving
and joining mid-decode change nobody else's tokens, and a packed step's cache is freed at once;
the decode-graph bookkeeping (one capture per slot shape, replayed across batch changes, all
dropped when the slots grow) is exact, with the graph stood in for on CPU; short prompts hit on
resend; a 10-turn chat reuses its previous turns."""
from __future__ import annotations

import copy
import dataclasses
import logging
import weakref
from typing import ClassVar

import pytest
import torch

from k3.config import load_config
from k3.generation.generate import generate
from k3.model.cache import KDAState, MLAState
from k3.model.transformer import K3ForCausalLM
from k3.serve import decode_slots as slots_module
from k3.serve.decode_graph import _restore, _snapshot
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.runner import STEP_KINDS
from k3.serve.sampling import SamplingParams
from k3.text.tokenizer import train_tokenizer
from k3.text.xtml import XTML
from tests.helpers import recompile_limit_hits
from tests.serve.fakes import one_torch_thread  # noqa: F401 (autouse fixture)

CORPUS = ["The quick brown fox jumps over the lazy dog.", "To be, or not to be, that is the question.",
          "Serving hybrid models needs prefix caching that works.", "hello world " * 3]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(CORPUS * 4, 320)


@pytest.fixture(scope="module")
def model(tokenizer):
    """k3-tiny cut to 4 layers, KDA and MLA twice each (MLA last, as in K3): every kind of paged
    state on more than one layer, at half the depth (the engine's checks are per layer kind)."""
    torch.manual_seed(0)
    cfg = load_config("k3-tiny").replace(vocab_size=tokenizer.get_vocab_size(), num_hidden_layers=4,
                                         kda_layers=[1, 3], full_attn_layers=[2, 4])
    return K3ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def prompts(model):
    g = torch.Generator().manual_seed(1)
    lengths = [3, 17, 40, 9]
    prompts = [torch.randint(6, model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    prompts.append(prompts[2][:30] + prompts[0])  # shares a prefix with the third
    return prompts


@pytest.fixture(scope="module")
def reference(model, prompts):
    return generate(model, prompts, 4)


GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def track_steps(engine: LLMEngine) -> tuple[list[weakref.ref], list[str]]:
    """Weak references to every K3Cache the runner builds from pages (packed steps), and per step
    that ran a forward what it did: 'packed', 'fill' (a decode step that refilled the slots) or
    'continue' (a decode step on the rows the previous one left)."""
    built, steps = [], []
    runner = engine.runner
    build_cache, execute = runner.build_cache, runner.execute

    def tracked_build(requests):
        cache = build_cache(requests)
        built.append(weakref.ref(cache))
        return cache

    def tracked_execute(out, params):
        packed, fills = runner.step_counts["packed"], runner.slot_fills
        sampled = execute(out, params)
        if out.requests:
            steps.append("packed" if runner.step_counts["packed"] > packed
                         else "fill" if runner.slot_fills > fills else "continue")
        return sampled

    runner.build_cache, runner.execute = tracked_build, tracked_execute
    return built, steps


@pytest.mark.parametrize("prefix_caching,budget,max_seqs", [
    (True, 256, 8), (True, 5, 8), (False, 7, 8), (True, 16, 1)],
    ids=["cache-whole", "cache-chunk5", "nocache-chunk7", "cache-chunk16-seqs1"])
def test_greedy_matches_generate(model, prompts, reference, prefix_caching, budget, max_seqs):
    engine = LLMEngine(model, EngineConfig(block_size=4, hash_block_size=8, max_num_batched_tokens=budget,
                                           max_num_seqs=max_seqs, enable_prefix_caching=prefix_caching))
    built, steps = track_steps(engine)
    assert engine.generate(prompts, GREEDY) == reference
    assert "continue" in steps  # decode steps ran on the rows the previous step left
    assert len(built) == steps.count("packed")
    # again, now from the prefix cache, and in another batch composition
    order = [4, 1, 3, 0, 2]
    assert engine.generate([prompts[i] for i in order], GREEDY) == [reference[i] for i in order]
    if prefix_caching:
        assert engine.cache.stats.hit_tokens > 0
    assert engine.cache.pool.num_free == engine.cache.pool.num_pages


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["cache", "nocache"])
def test_pool_bytes_no_request_wrote_never_reach_an_output(model, prompts, reference, prefix_caching):
    """The page pool starts uninitialized (torch.empty) and a page can hold a KDA state, then MLA
    latents: the tail of a request's last latent page and the padding pages hold bytes no request
    wrote, which as bf16 can be NaN or inf. Here all of them are NaN (0xFF bytes), through chunked
    prefills, decode-slot fills and the second, reordered pass."""
    engine = LLMEngine(model, EngineConfig(block_size=4, hash_block_size=8, max_num_batched_tokens=7,
                                           enable_prefix_caching=prefix_caching))
    engine.runner.pool.fill_(0xFF)
    assert engine.generate(prompts, GREEDY) == reference
    order = [4, 1, 3, 0, 2]
    assert engine.generate([prompts[i] for i in order], GREEDY) == [reference[i] for i in order]


@pytest.mark.parametrize("layers", ["mla", "kda"])
def test_models_of_one_mixer_kind_serve_like_generate(model, prompts, layers):
    """A model with only MLA layers (no KDA states to page) or only KDA layers (no latents)."""
    n = model.config.num_hidden_layers
    mla = list(range(1, n + 1)) if layers == "mla" else []
    torch.manual_seed(0)
    one_kind = K3ForCausalLM(model.config.replace(
        full_attn_layers=mla, kda_layers=[i for i in range(1, n + 1) if i not in mla])).eval()
    engine = LLMEngine(one_kind, EngineConfig(block_size=4, hash_block_size=8, max_num_batched_tokens=7))
    assert engine.generate(prompts, GREEDY) == generate(one_kind, prompts, 4)


def test_compiled_regions_change_no_token(model, prompts, reference, caplog):
    """EngineConfig.compile traces the norms, mixers, FFNs and AttnRes reads for decode steps (a
    recording backend that runs dynamo's graphs as they are: fast on CPU), packed steps run the
    same regions eagerly: the tokens are unchanged, every traced region saw one-token rows only,
    and no region exhausts its recompiles and silently falls back to eager. In the default run,
    tests/test_compile.py checks the traced regions against eager (training, and decode writing the
    cache in place)."""
    TRACED.clear()
    if "k3_record_shapes" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(_record_shapes, name="k3_record_shapes")
    engine = LLMEngine(copy.deepcopy(model), EngineConfig(block_size=4, hash_block_size=8, compile="k3_record_shapes"))
    with caplog.at_level(logging.WARNING, logger="torch._dynamo"):
        assert engine.generate(prompts, GREEDY) == reference
    assert not recompile_limit_hits(caplog)
    rows = [s for s in TRACED if len(s) == 3 and s[-1] == model.config.hidden_size]  # hidden states [B, T, D]
    assert engine.runner.step_counts["packed"] and rows and {s[1] for s in rows} == {1}, rows


TRACED: list[tuple[int, ...]] = []  # the input shapes of every graph dynamo handed _record_shapes


def _record_shapes(gm, example_inputs):
    """A torch.compile backend that runs dynamo's graph as traced, noting its tensor inputs' shapes."""
    TRACED.extend(tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor))
    return gm.forward


def test_requests_leaving_and_joining_mid_decode_keep_every_output_exact(model, prompts):
    engine = LLMEngine(model, EngineConfig(block_size=4, hash_block_size=8))
    built, steps = track_steps(engine)

    def greedy(n: int) -> SamplingParams:
        return dataclasses.replace(GREEDY, max_tokens=n)

    # the prefill stops one token short (a KDA checkpoint at prompt_len - 1): token k comes at step k + 1
    # KDA state pages written per step (the runner's one writer of state pages)
    written: list[list[int]] = []
    write_snapshots = engine.runner.write_snapshots

    def recorded_write(pages, conv, recurrent):
        written[-1].extend(p for ps in pages for p in ps)
        return write_snapshots(pages, conv, recurrent)
    engine.runner.write_snapshots = recorded_write

    stays = engine.add_request(prompts[0], greedy(8))
    finishes = engine.add_request(prompts[1], greedy(3))  # at step 4
    cancelled = engine.add_request(prompts[3], greedy(8))  # after step 6
    while engine.has_unfinished:
        written.append([])
        engine.step()
        if len(steps) == 4:  # takes the finished one's place: a prefix hit, one token to compute
            joins = engine.add_request(prompts[1], greedy(5))
        if len(steps) == 6:
            cancelled_pages = {p for ps in engine.scheduler.cache.state_pages(cancelled.request_id) for p in ps}
            engine.abort(cancelled.request_id)
        assert all(ref() is None for ref in built)  # a packed step's cache is freed with the step
    assert engine.runner.slots.holds is None  # idle: the slots hold no finished request
    assert joins.num_cached_tokens == len(prompts[1]) - 1
    # the slots are filled after the prefill (step 2), for the batch with one left and one joined
    # (step 5) and after the cancellation (step 7); the other decode steps continue on them
    assert steps == ["packed", "fill", "continue", "continue", "fill", "continue", "fill", "continue", "continue"]
    # decode steps leave the KDA states in the slots: they reach pages after the prefill, when the
    # slots are refilled, and for a request that stopped, into the pages the prefix cache adopted as
    # its checkpoint, in the step it stopped (steps 4 and 9; the cancelled one at step 7)
    assert [bool(w) for w in written] == [True, False, False, True, True, False, True, False, True]
    assert cancelled_pages <= set(written[6])
    for request, prompt, n in [(stays, 0, 8), (finishes, 1, 3), (joins, 1, 5)]:
        assert request.output_token_ids == generate(model, [prompts[prompt]], n)[0]
    assert cancelled.output_token_ids == generate(model, [prompts[3]], 8)[0][:5]
    assert engine.cache.pool.num_free == engine.cache.pool.num_pages


class StandInGraph:
    """CUDAGraphDecoder's contract on CPU: a warm-up step that the cache is restored from, then
    each step runs on exactly the tensors seen at capture (a real graph would read and write those
    addresses whatever the cache held later; a reallocated buffer would go silently stale)."""
    # shared by every instance on purpose: the test reads what all the captures saw
    shapes: ClassVar[list[tuple[int, int]]] = []
    pools_given: ClassVar[list] = []
    pools_made: ClassVar[list] = []

    def __init__(self, model, cache, warmup_steps: int = 2, pool=None):
        mla = next(s for s in cache.layers if isinstance(s, MLAState))
        StandInGraph.shapes.append((cache.num_seqs, mla.capacity))
        self.model, self.cache, self.addresses = model, cache, self._addresses(cache)
        StandInGraph.pools_given.append(pool)
        self.pool = object()  # a token for the memory pool a real graph would have made or joined
        StandInGraph.pools_made.append(self.pool)
        saved = _snapshot(cache)
        for _ in range(warmup_steps):
            model(torch.zeros(cache.num_seqs, 1, dtype=torch.long), cache=cache)
        _restore(cache, saved)

    @staticmethod
    def _addresses(cache) -> list[int]:
        return [t.data_ptr() for s in cache.layers
                for t in ((s.conv, s.recurrent) if isinstance(s, KDAState) else (s.buffer, s.lengths))]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self._addresses(self.cache) == self.addresses, "a cache tensor moved under a live graph"
        assert all(s.capacity > int(self.cache.lengths.max()) for s in self.cache.layers if isinstance(s, MLAState))
        return self.model(tokens.view(-1, 1), cache=self.cache)[:, 0]


def test_decode_graphs_one_capture_per_shape_replayed_across_batches(model, prompts, monkeypatch):
    monkeypatch.setattr(slots_module, "CUDAGraphDecoder", StandInGraph)
    # small latent column steps, so the longest request outgrows its columns mid-decode
    monkeypatch.setattr(slots_module, "MLA_CAPACITY_STEP", 16)
    engine = LLMEngine(model, EngineConfig(block_size=4, hash_block_size=8))
    runner = engine.runner
    runner.slots.cuda_graphs = runner.cuda_graphs = True  # what a CUDA device with grouped_mm experts sets
    StandInGraph.shapes, StandInGraph.pools_given, StandInGraph.pools_made = [], [], []
    _, steps = track_steps(engine)

    def greedy(n: int) -> SamplingParams:
        return dataclasses.replace(GREEDY, max_tokens=n)

    # prompts of 40, 3 and 9 tokens; the second finishes at step 3 and the third joins then
    long = engine.add_request(prompts[2], greedy(30))
    short = engine.add_request(prompts[0], greedy(3))
    while engine.has_unfinished:
        engine.step()
        if len(steps) == 3:
            joins = engine.add_request(prompts[3], greedy(20))
    for request, prompt, n in [(long, 2, 30), (short, 0, 3), (joins, 3, 20)]:
        assert request.output_token_ids == generate(model, [prompts[prompt]], n)[0]
    counts = runner.step_counts
    # every shape captured once, and replayed after batch changes refilled the slots
    assert len(StandInGraph.shapes) == len(set(StandInGraph.shapes)) == counts["decode_graph_capture"], StandInGraph.shapes
    assert counts["decode_graph_replay"] > 0 and runner.slot_fills > counts["decode_graph_capture"], (counts, runner.slot_fills)
    # the first pair captures (2 rows, 64 columns: 40 + 1 tokens in 16-column steps, rounded up to
    # a power of two); the second pair (after the join) replays that graph on other requests; the
    # long request alone captures (1, 64), then outgrows 64 columns: the slots grow, every graph is
    # dropped, and (1, 128) is captured
    assert StandInGraph.shapes == [(2, 64), (1, 64), (1, 128)]
    # the second capture joins the first one's memory pool; after the growth dropped both, the
    # third starts a new one (a retired pool's id cannot be captured into again)
    assert StandInGraph.pools_given == [None, StandInGraph.pools_made[0], None]
    assert steps.count("fill") == 4 and counts["decode_eager"] == 0
    assert sum(counts[k] for k in STEP_KINDS if k.startswith("decode")) + counts["packed"] == len(steps)


def test_short_prompt_hits_on_second_send(model):
    engine = LLMEngine(model, EngineConfig(block_size=16, hash_block_size=64))
    prompt = [7, 8, 9, 10, 11]  # shorter than one page and one hash block
    first = engine.generate([prompt], GREEDY)
    assert engine.cache.stats.hits == 0
    assert engine.generate([prompt], GREEDY) == first
    assert engine.cache.stats.hits == 1 and engine.cache.stats.hit_tokens == len(prompt) - 1


def test_ten_turn_chat_reuses_previous_turns(model, tokenizer):
    chat = XTML(tokenizer)
    engine = LLMEngine(model, EngineConfig(block_size=16, hash_block_size=64))
    messages = [{"role": "system", "content": "You are a helpful assistant. Answer briefly and kindly."}]
    rates = []
    for turn in range(10):
        messages.append({"role": "user", "content": f"Question {turn}: what is {turn} plus {turn}?"})
        prompt = chat.render(messages)
        request = engine.add_request(prompt.token_ids, SamplingParams(max_tokens=8, temperature=0.0),
                                     boundaries=prompt.boundaries, eos_token_id=chat.end_of_msg)
        while not request.status.finished:
            engine.step()
        rates.append(request.num_cached_tokens / request.num_prompt_tokens)
        parser = chat.parser_for(prompt)
        parser.feed(request.output_token_ids)
        parser.finish()
        messages.append({"role": "assistant", "content": parser.reply.content,
                         "reasoning": parser.reply.reasoning or None})
    hit_rate = sum(rates[1:]) / 9
    print(f"10-turn chat: prompt-token hit rate on turns 2-10 = {hit_rate:.1%} (per turn {[f'{r:.0%}' for r in rates]})")
    assert rates[0] == 0 and hit_rate >= 0.7


@pytest.mark.parametrize("how", ["finished", "aborted", "idle"])
def test_a_stopped_request_leaves_its_state_for_the_next_turn(model, prompts, how):
    """Where a request stops (finished, aborted mid-decode, or the last one before the engine goes
    idle), its KDA state is cached: a prompt that extends its tokens computes only what is new, and
    decodes what a fresh model would."""
    engine = LLMEngine(model, EngineConfig(block_size=4, hash_block_size=8))
    first = engine.add_request(prompts[2], dataclasses.replace(GREEDY, max_tokens=9))
    other = engine.add_request(prompts[0], dataclasses.replace(GREEDY, max_tokens=12)) if how != "idle" else None
    while not first.status.finished:
        engine.step()
        if how == "aborted" and len(first.output_token_ids) == 5:
            engine.abort(first.request_id)
    stopped = prompts[2] + first.output_token_ids
    follow = engine.add_request(stopped + prompts[1][:6], dataclasses.replace(GREEDY, max_tokens=5))
    while engine.has_unfinished:
        engine.step()
    assert len(first.output_token_ids) == (5 if how == "aborted" else 9)
    assert follow.num_cached_tokens == len(stopped) - 1  # all but the last token, which was never run
    assert follow.output_token_ids == generate(model, [stopped + prompts[1][:6]], 5)[0]
    if other is not None:
        assert other.output_token_ids == generate(model, [prompts[0]], 12)[0]
    assert engine.cache.pool.num_free == engine.cache.pool.num_pages


def test_one_token_prompt_decodes_from_an_empty_cache(model, prompts):
    """One-token prompts: the first step is a decode step with nothing cached yet, so the slots
    are filled with zero latent columns."""
    engine = LLMEngine(model, EngineConfig(block_size=4, hash_block_size=8))
    batch = [prompts[0][:1], prompts[1][:1]]
    assert engine.generate(batch, GREEDY) == generate(model, batch, 4)
