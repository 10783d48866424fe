"""lm-evaluation-harness, unmodified, against a live `k3 serve` app.

lm-eval 0.4.x runs as a library with its `local-completions` model (token-id requests, the served
checkpoint's tokenizer.json through its huggingface backend) on three tasks written here from
local JSONL, offline: multiple choice (`loglikelihood`: echo + logprobs, max_tokens 1),
a perplexity task long enough for two rolling windows (`loglikelihood_rolling`) and a
`generate_until` task. Every per-sample loglikelihood lm-eval records equals k3's own sum of the
targets' log-probabilities (`log_softmax` of K3ForCausalLM's logits on the same ids) within 1e-4,
and every generated answer equals greedy `k3.generate`, cut at the task's stop string.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from k3 import K3ForCausalLM, generate
from k3.serve.api.server import ServerThread, build_app
from k3.serve.engine import AsyncEngine, EngineConfig, LLMEngine
from k3.text.tokenizer import save_tokenizer, train_tokenizer
from tests.helpers.models import randomized, small_config
from tests.serve.fakes import one_torch_thread  # noqa: F401 (autouse fixture)

pytest.importorskip("lm_eval", minversion="0.4")  # datasets, which reads HF_*_OFFLINE once, loads later

CORPUS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
          "To be, or not to be, that is the question."] * 8
MC = [{"question": "The quick brown", "choices": ["fox", "dog", "cat"], "answer": 0},
      {"question": "Paris is the capital of", "choices": ["France", "Spain"], "answer": 0},
      {"question": "To be, or not to", "choices": ["be", "see", "go", "the question"], "answer": 0}]
PPL = [{"text": "To be, or not to be, that is the question. The quick brown fox jumps over the lazy dog."},
       {"text": "Paris is the capital of France."}]
GEN = [{"question": "The quick brown", "answer": " fox"}, {"question": "Paris is", "answer": " the"}]
MAX_LENGTH = 24  # lm-eval's context window: the long PPL text needs two rolling windows
STOP = "."
TASKS = {
    "k3_mc": ("mc", MC, ('output_type: multiple_choice\ndoc_to_text: "{{question}}"\n'
                         'doc_to_choice: "{{choices}}"\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n')),
    "k3_ppl": ("ppl", PPL, ('output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
                            "metric_list:\n  - metric: word_perplexity\n")),
    "k3_gen": ("gen", GEN, (f'output_type: generate_until\ndoc_to_text: "{{{{question}}}}"\ndoc_to_target: answer\n'
                            f'generation_kwargs:\n  until: ["{STOP}"]\n  max_gen_toks: 6\n'
                            "metric_list:\n  - metric: exact_match\n")),
}


def write_tasks(root) -> None:
    """One YAML per task over a local JSONL file (the `json` dataset builder: no hub access)."""
    for task, (name, rows, body) in TASKS.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (root / f"{name}.yaml").write_text(
            f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / name}.jsonl\n"
            f"  cache_dir: {root / 'hf-cache'}\ntest_split: test\n{body}")


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """The model, its tokenizer and lm-eval's logged samples of the three tasks."""
    root = tmp_path_factory.mktemp("lm_eval")
    saved = {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    tok = train_tokenizer(CORPUS, 300)
    folder = root / "checkpoint"
    folder.mkdir()
    save_tokenizer(tok, folder)  # tokenizer.json + tokenizer_config.json: what lm-eval loads
    torch.manual_seed(0)
    model = randomized(K3ForCausalLM(small_config(vocab_size=tok.get_vocab_size())))
    write_tasks(root)
    engine = LLMEngine(model, EngineConfig(block_size=4, hash_block_size=8, max_model_len=128))
    try:
        with ServerThread(build_app(AsyncEngine(engine, tok), tok, model_name="k3-test")) as server:
            lm = lm_eval.api.registry.get_model("local-completions")(
                model="k3-test", base_url=server.url + "/v1/completions", tokenizer=str(folder),
                tokenizer_backend="huggingface", max_length=MAX_LENGTH, num_concurrent=4)
            results = lm_eval.simple_evaluate(model=lm, tasks=list(TASKS), log_samples=True,
                                              task_manager=TaskManager(include_path=str(root), include_defaults=False))
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return model, tok, lm, results


def target_logprob_sum(model, context: list[int], targets: list[int]) -> float:
    """k3's own log-probability of `targets` after `context`: log_softmax of K3ForCausalLM's logits."""
    ids = torch.tensor([context + targets])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids)[0].double(), dim=-1)
    positions = torch.arange(len(context) - 1, len(context) + len(targets) - 1)
    return logprobs[positions, torch.tensor(targets)].sum().item()


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def close(got: float, want: float) -> bool:
    return abs(got - want) <= 1e-4 * max(1.0, abs(want))


def test_multiple_choice_loglikelihoods(evaluated):
    model, tok, _, results = evaluated
    samples = results["samples"]["k3_mc"]
    assert len(samples) == len(MC)
    for sample in samples:
        for (context, continuation), (loglikelihood, _) in zip(sample["arguments"], sample["filtered_resps"]):
            # lm-eval's split: trailing spaces of the context move to the continuation; the whole is
            # encoded once and the continuation is what follows the context's own encoding
            n = len(context) - len(context.rstrip())
            context, continuation = context[:len(context) - n], context[len(context) - n:] + continuation
            whole, ctx = encode(tok, context + continuation), encode(tok, context)
            want = target_logprob_sum(model, ctx, whole[len(ctx):])
            assert close(loglikelihood, want), (context, continuation, loglikelihood, want)
    assert 0.0 <= results["results"]["k3_mc"]["acc,none"] <= 1.0


def test_rolling_loglikelihoods(evaluated):
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    model, tok, lm, results = evaluated
    samples = results["samples"]["k3_ppl"]
    assert len(samples) == len(PPL)
    windows_seen = 0
    for sample in samples:
        text = sample["arguments"][0][0]
        windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
            encode(tok, text), prefix_token=tok.token_to_id("<|bos|>"), max_seq_len=lm.max_length - 1, context_len=1)]
        windows_seen = max(windows_seen, len(windows))
        want = sum(target_logprob_sum(model, context, targets) for context, targets in windows)
        assert close(sample["filtered_resps"][0], want), (text, sample["filtered_resps"], want)
    assert windows_seen >= 2


def test_generated_answers_equal_greedy_generate(evaluated):
    model, tok, _, results = evaluated
    samples = results["samples"]["k3_gen"]
    assert len(samples) == len(GEN)
    for sample in samples:
        context = sample["arguments"][0][0]
        out = generate(model, [encode(tok, context)], 6, eos_token_id=model.config.eos_token_id)[0]
        want = tok.decode(out, skip_special_tokens=True).split(STOP)[0]
        assert sample["filtered_resps"][0] == want, (context, sample["filtered_resps"], want)
