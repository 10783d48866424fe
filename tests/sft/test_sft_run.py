"""`k3 sft` end to end on a very small model: training from a `k3 train` run, exact resume, the loss
mask in the packed batches, bad data refused before anything is written, and the chat-tuned mark."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from k3.sft.batches import example, pack_examples
from k3.sft.cli import add_arguments, run
from k3.sft.trainer import SFTSettings, SFTTrainer
from k3.train.packing import IGNORE_INDEX
from tests.helpers.train import losses, quiet, trained_tiny_run


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    return trained_tiny_run(tmp_path_factory.mktemp("pre"))


def sft_settings(pretrained: Path, out: Path, **changes) -> SFTSettings:
    base = SFTSettings(init=str(pretrained), out=str(out), train_size=24, val_size=6, steps=4, batch_size=4,
                       seq_len=4096, eval_every=2, ckpt_every=2, agent_episodes=3, max_reply_tokens=6,
                       cache_dir=str(out.parent / "cache"))
    return dataclasses.replace(base, **changes)


def sft(settings: SFTSettings, resume: bool = False) -> dict:
    trainer = (SFTTrainer.from_run(settings.out, progress=False, log=quiet) if resume
               else SFTTrainer(settings, progress=False, log=quiet))
    try:
        return trainer.train()
    finally:
        trainer.close()


def test_pack_examples_labels_only_assistant_tokens():
    a = example([5, 6, 7, 8, 9], [False, False, True, True, True], line=1)
    b = example([10, 11, 12], [False, True, False], line=2)
    batch = pack_examples([a, b])
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 10, 11]]
    assert batch.labels.tolist() == [[IGNORE_INDEX, 7, 8, 9, 11, IGNORE_INDEX]]
    assert batch.cu_seqlens.tolist() == [0, 4, 6]  # each conversation its own segment
    assert a.targets + b.targets == int((batch.labels != IGNORE_INDEX).sum())


def test_sft_trains_resumes_exactly_and_marks_the_model_chat_tuned(pretrained, tmp_path):
    straight = sft(sft_settings(pretrained, tmp_path / "a"))
    assert straight["agent"]["episodes"] == 3
    killed = SFTTrainer(sft_settings(pretrained, tmp_path / "b"), progress=False, log=quiet)
    for _ in range(3):  # as if killed during step 3, after the step-2 checkpoint
        killed._record([killed.train_step()])
        if killed.step == 2:
            killed._save()
    killed.close()
    sft(sft_settings(pretrained, tmp_path / "b"), resume=True)
    assert losses(tmp_path / "a") == losses(tmp_path / "b")  # bit for bit
    ckpt = Path(straight["checkpoint"])
    assert json.loads((ckpt / "tokenizer_config.json").read_text()).get("chat_template")
    report = (tmp_path / "a" / "report.md").read_text()
    assert "Held-out agent episodes" in report and (tmp_path / "a" / "loss.png").is_file()
    records = [json.loads(l) for l in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert {r["kind"] for r in records} >= {"train", "eval", "agent"}
    from k3.serve.loading import load_for_serving

    assert load_for_serving(str(tmp_path / "a")).chat_tuned


BAD = {
    "no_role": {"messages": [{"content": "hi"}, {"role": "assistant", "content": "x"}]},
    "unknown_call_id": {"messages": [{"role": "user", "content": "q"},
                                     {"role": "assistant", "content": None, "tool_calls": [
                                         {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                                     {"role": "tool", "tool_call_id": "c9", "content": "r"},
                                     {"role": "assistant", "content": "a"}]},
    "bad_json_arguments": {"messages": [{"role": "user", "content": "q"},
                                        {"role": "assistant", "content": None, "tool_calls": [
                                            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
    "too_long": {"messages": [{"role": "user", "content": "word " * 3000}, {"role": "assistant", "content": "ok"}]},
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_sft_data_is_one_line_naming_the_line_and_writes_nothing(case, pretrained, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    data.write_text("".join(json.dumps(c) + "\n" for c in [good, good, BAD[case], good]))
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "out"
    args = parser.parse_args(["--run", str(pretrained), "--data", str(data), "--out", str(out), "--seq-len", "2048",
                              "--no-progress"])
    assert run(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("k3 sft: error: ") and "\n" not in err, err
    assert f"{data}:3:" in err, err
    assert not out.exists()


@pytest.mark.parametrize("flags,what", [(["--val-data", "x.jsonl"], "--val-data goes with --data"),
                                        (["--data", "x.jsonl", "--train-size", "5"], "size the default set")])
def test_flags_the_data_source_would_ignore_are_refused(flags, what, pretrained, tmp_path, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "out"
    assert run(parser.parse_args(["--run", str(pretrained), "--out", str(out), "--no-progress", *flags])) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("k3 sft: error: ") and what in err and "\n" not in err, err
    assert not out.exists()


def test_sft_refuses_a_tokenizer_without_the_chat_markers(pretrained, tmp_path):
    from k3.train.errors import TrainError

    ckpt = max((pretrained / "checkpoints").iterdir())
    broken = tmp_path / "ckpt"
    broken.mkdir()
    for f in ckpt.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    text = (broken / "tokenizer.json").read_text()  # as if trained before K3's fourth marker existed
    (broken / "tokenizer.json").write_text(text.replace("<|end_of_msg|>", "<|something_else|>"))
    with pytest.raises(TrainError, match="end_of_msg"):
        SFTTrainer(sft_settings(broken, tmp_path / "out"), progress=False, log=quiet)
    assert not (tmp_path / "out").exists()


def test_sft_loss_is_on_assistant_tokens_only(pretrained, tmp_path):
    trainer = SFTTrainer(sft_settings(pretrained, tmp_path / "m", steps=1), progress=False, log=quiet)
    try:
        ex = trainer.train_examples[0]
        ids = ex.ids.tolist()
        text = trainer.tokenizer.decode([t for t, m in zip(ids, ex.mask) if m], skip_special_tokens=False)
        assert "role=\"user\"" not in text and "<|end_of_msg|>" in text
        batch = pack_examples([ex])
        assert torch.equal(batch.labels[0] != IGNORE_INDEX, torch.from_numpy(ex.mask[1:]))
    finally:
        trainer.close()


def test_shared_prefixes_give_the_whole_rows_loss_and_gradient(pretrained, tmp_path):
    """The default set's conversations repeat their system messages: `share_prefixes` runs them once
    per distinct prefix (k3/train/prefix_tree.py) for the same summed loss and gradient."""
    trainer = SFTTrainer(sft_settings(pretrained, tmp_path / "p", steps=1), progress=False, log=quiet)
    try:
        batch = pack_examples(trainer.train_examples[:6])
        results = []
        for share in (False, True):
            trainer.s = dataclasses.replace(trainer.s, share_prefixes=share)
            trainer.model.zero_grad(set_to_none=True)
            loss = trainer._loss_sum(batch)
            loss.backward()
            results.append((float(loss.detach()), {n: p.grad.clone() for n, p in trainer.model.named_parameters()
                                          if p.grad is not None}))
        (whole, g_whole), (shared, g_shared) = results
        assert abs(shared - whole) <= 1e-5 * abs(whole)
        assert g_whole.keys() == g_shared.keys()
        for name, g in g_whole.items():
            assert (g_shared[name] - g).norm() <= 1e-4 * g.norm().clamp_min(1e-12), name
    finally:
        trainer.close()


def test_each_lines_reasoning_effort_is_rendered_into_its_example(pretrained, tmp_path):
    """A JSONL line's `reasoning_effort` becomes its thinking-effort system message (the form the
    server renders for that effort), and a line without one gets the chat default."""
    reply = {"role": "assistant", "reasoning_content": "Add them.", "content": "5"}
    lines = [{"messages": [{"role": "user", "content": f"What is {i} + 5?"}, reply], **effort}
             for i in range(4) for effort in ({"reasoning_effort": "low"}, {"reasoning_effort": "high"}, {})]
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    trainer = SFTTrainer(sft_settings(pretrained, tmp_path / "e", steps=1, data=str(data), val_fraction=0.25),
                         progress=False, log=quiet)
    try:
        rendered = {trainer.tokenizer.decode(ex.ids.tolist(), skip_special_tokens=False)
                    for ex in trainer.train_examples + trainer.val_examples}
        want = {trainer.tokenizer.decode(trainer.chat.render(x["messages"], reasoning_effort=x.get("reasoning_effort"),
                                                             add_generation_prompt=False).token_ids,
                                         skip_special_tokens=False) for x in lines}
        assert rendered == want and len(want) == len(lines)
        first = lines[0]["messages"]
        by_effort = {tuple(trainer.chat.render(first, reasoning_effort=e, add_generation_prompt=False).token_ids)
                     for e in ("low", "high", None)}
        assert len(by_effort) == 3  # the effort changes the tokens
    finally:
        trainer.close()


def test_sft_through_the_graph_step_trains_as_eager(pretrained, tmp_path, monkeypatch):
    """Rows padded to token buckets with an ignored pad document (CPU: GraphStep runs its body
    eagerly in host-free mode), Quantile Balancing counting the real tokens only. Whole
    conversations both ways: shared prefixes, which captured steps do not use, record each shared
    token once (the same loss, other balance statistics)."""
    from k3.train.trainer import Trainer

    common = {"steps": 2, "eval_every": 2, "ckpt_every": 2, "agent_episodes": 0, "share_prefixes": False,
              "train_size": 8, "val_size": 2}
    sft(sft_settings(pretrained, tmp_path / "eager", **common))
    monkeypatch.setattr(Trainer, "_graph_refusal", lambda self: None)
    sft(sft_settings(pretrained, tmp_path / "graphed", **common))
    assert losses(tmp_path / "graphed") == pytest.approx(losses(tmp_path / "eager"), rel=1e-5)
    weights = [load_file(next((tmp_path / run / "checkpoints" / "step_0000002").glob("model-*.safetensors")))
               for run in ("eager", "graphed")]
    biases = [name for name in weights[0] if name.endswith("e_score_correction_bias")]
    assert biases
    for name in biases:  # the balance rule saw the same tokens: the pad tokens did not count
        torch.testing.assert_close(weights[1][name], weights[0][name], rtol=1e-5, atol=1e-6)
