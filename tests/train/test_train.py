"""`k3 train` end to end on a very small config: outputs, exact resume (also after a kill during a
checkpoint write), bad input, and `k3 generate` on the result."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3.data.corpus import load_documents, split_documents
from k3.generation import cli as generate_cli
from k3.train import cli as train_cli
from k3.train.metrics import MetricsLog
from k3.train.trainer import Trainer, TrainError, TrainSettings
from tests.helpers.train import REPO, losses, quiet, tiny_settings


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    settings = tiny_settings(root, "ref", eval_windows=None)  # every eval reads all of val
    result = Trainer(settings, progress=False, log=quiet).train()
    return root, settings, result


def test_run_writes_everything(reference_run):
    _root, settings, result = reference_run
    run = Path(settings.out)
    for name in ("run.json", "tokenizer.json", "metrics.jsonl", "loss.png", "report.md"):
        assert (run / name).is_file(), name
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["step_0000004", "step_0000006"]  # keep=2
    last = run / "checkpoints" / "step_0000006"
    for name in ("config.json", "model.safetensors.index.json", "tokenizer.json", "optimizer.safetensors",
                 "rng.safetensors", "trainer_state.json"):
        assert (last / name).is_file(), name
    older = run / "checkpoints" / "step_0000004"  # weights and tokenizer only: resume reads the latest
    assert sorted(p.name for p in older.iterdir()) == [
        "config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json", "tokenizer.json",
        "tokenizer_config.json"]
    state = json.loads((last / "trainer_state.json").read_text())
    assert state["step"] == 6 and state["data_position"] == 6 * settings.batch_size
    curve = losses(run)
    assert len(curve) == 6 and curve[-1] < curve[0]
    # bits per byte: every eval covers every byte of the val documents, so evals are comparable
    _, val = split_documents(load_documents(settings.data), settings.val_fraction)
    assert result["val_bytes"] == sum(len(d.text.encode()) for d in val)
    evals = [r for r in MetricsLog(run).read() if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [3, 6]
    assert {(r["val_tokens"], r["val_bytes"]) for r in evals} == {(result["val_tokens"], result["val_bytes"])}
    assert 0 < result["val_bpb"] < 8
    report = (run / "report.md").read_text()
    assert "bits per byte" in report and "tokens seen" in report and "Samples" in report


KILL_DURING_WRITE = """
import json, os, signal, sys
import k3.checkpoint.training_state as ckpt
from k3.train.trainer import Trainer, TrainSettings
real = ckpt.save_file
def dying_save_file(tensors, path, *a, **k):
    if path.endswith("optimizer.safetensors") and "step_0000004" in path:
        with open(path, "wb") as f:
            f.write(b"half a file")
        os.kill(os.getpid(), signal.SIGKILL)  # a real kill, mid-checkpoint
    return real(tensors, path, *a, **k)
ckpt.save_file = dying_save_file
settings = json.loads(sys.argv[1])
settings["sample_prompts"] = tuple(settings["sample_prompts"])
Trainer(TrainSettings(**settings), progress=False).train()
"""


def test_resume_after_kill_during_checkpoint_write_is_exact(reference_run):
    root, settings, _ = reference_run
    killed = tiny_settings(root, "killed")
    proc = subprocess.run([sys.executable, "-c", KILL_DURING_WRITE, json.dumps(dataclasses.asdict(killed))],
                          check=False, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    ckpts = Path(killed.out) / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [".step_0000004.tmp", "step_0000002"]
    assert len(losses(killed.out)) == 4  # it got past step 4 before dying in the write
    trainer = Trainer.from_run(killed.out, progress=False, log=quiet)
    assert trainer.step == 2  # the half-written step 4 is never picked up
    trainer.train()
    assert losses(killed.out) == losses(settings.out)  # bit for bit
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_0000004", "step_0000006"]


def _cli(argv: list[str], module=train_cli) -> int:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return module.run(parser.parse_args(argv))


def test_generate_streams_text(reference_run, capsys):
    _, settings, _ = reference_run
    assert _cli(["--run", settings.out, "--prompt", "To be", "--max-tokens", "8", "--greedy"], generate_cli) == 0
    out = capsys.readouterr().out
    assert out.startswith("To be") and len(out) > len("To be\n")
    assert _cli(["--run", str(Path(settings.out) / "nope"), "--prompt", "x"], generate_cli) == 2


@pytest.mark.parametrize("case", ["missing-data", "empty-corpus", "unknown-preset", "seq-too-long", "unwritable-out",
                                  "resume-with-flags", "bad-device", "cuda-missing", "small-vocab",
                                  "resume-corrupt-run", "resume-unknown-key", "negative-grad-clip", "wrong-type-set",
                                  "infinite-lr"])
def test_bad_input_is_a_clear_error_with_no_output(tmp_path, capsys, case):
    out = tmp_path / "run"
    argv = ["--out", str(out), "--cache-dir", str(tmp_path / "cache"), "--no-progress"]
    if case == "missing-data":
        argv += ["--data", str(tmp_path / "nothing-here")]
    elif case == "empty-corpus":
        (tmp_path / "empty").mkdir()
        argv += ["--data", str(tmp_path / "empty")]
    elif case == "unknown-preset":
        argv += ["--config", "k3-huge"]
    elif case == "seq-too-long":
        argv += ["--seq-len", "100000"]
    elif case == "unwritable-out":
        (tmp_path / "a-file").write_text("x")
        out = tmp_path / "a-file" / "run"
        argv = ["--out", str(out), "--no-progress"]
    elif case == "resume-with-flags":
        argv = ["--resume", str(out), "--steps", "3"]
    elif case == "bad-device":
        argv += ["--device", "foo"]
    elif case == "cuda-missing":
        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
        argv += ["--device", "cuda"]
    elif case == "small-vocab":
        argv += ["--set", "vocab_size=100"]
    elif case == "negative-grad-clip":  # was accepted: gradient ascent
        argv += ["--grad-clip", "-1"]
    elif case == "wrong-type-set":  # was accepted: `true` trained a 1-layer model
        argv += ["--set", "num_hidden_layers=true"]
    elif case == "infinite-lr":
        argv += ["--lr", "inf"]
    elif case in ("resume-corrupt-run", "resume-unknown-key"):
        out.mkdir()
        (out / "run.json").write_text('{"steps": 3' if case == "resume-corrupt-run" else '{"steps": 3, "bogus": 1}')
        argv = ["--resume", str(out)]
    assert _cli(argv) == 2
    err = capsys.readouterr().err
    expected = {"missing-data": "does not exist", "empty-corpus": "empty corpus", "unknown-preset": "unknown preset",
                "seq-too-long": "sequence length 100000", "unwritable-out": "not writable",
                "resume-with-flags": "drop --steps", "bad-device": "device must be", "cuda-missing": "no CUDA",
                "small-vocab": "vocab_size must be an integer >= 263", "resume-corrupt-run": "not a readable run file",
                "resume-unknown-key": "unknown settings ['bogus']", "negative-grad-clip": "grad clip must be > 0",
                "wrong-type-set": "K3Config.num_hidden_layers: must be an integer, got True",
                "infinite-lr": "learning rate must be a finite number > 0"}[case]
    assert err.startswith("k3 train: error:") and expected in err and err.count("\n") == 1, err
    if case.startswith(("resume-c", "resume-u")):
        assert sorted(p.name for p in out.iterdir()) == ["run.json"]
    else:
        assert not out.exists()


def test_run_json_keeps_paths_absolute(tmp_path, monkeypatch):
    """Relative --config / --data / --cache-dir resolve against the working directory of the first
    launch; run.json stores them absolute so --resume from elsewhere reads the same files. A preset
    name stays a name, an absent path stays as given."""
    from k3.train.trainer import run_record
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text("x")
    (tmp_path / "k3-tiny").mkdir()  # a folder named like a preset does not make the preset a path
    record = run_record(TrainSettings(data="corpus.txt", cache_dir="nowhere", config="k3-tiny"))
    assert (record["data"], record["cache_dir"], record["config"]) == (str(tmp_path / "corpus.txt"), "nowhere", "k3-tiny")


def test_grad_accumulation_matches_one_micro_batch(tmp_path):
    """4 sequences as 2 micro-batches of 2 = one batch of 4 (loss normalized by the step's targets).
    Balancing is off: it reads the last micro-batch's router scores only."""
    def run(name, accum):
        t = Trainer(tiny_settings(tmp_path, name, grad_accum=accum, balance="none"), progress=False, log=quiet)
        return [t.train_step()["loss"] for _ in range(3)]

    whole, split = run("whole", 1), run("split", 2)
    for a, b in zip(whole, split):
        assert abs(a - b) / a < 1e-5, (whole, split)


def test_metrics_skip_a_partial_last_line(tmp_path):
    """kill -9 during an append leaves half a line: resume reads past it and truncation drops it."""
    log = MetricsLog(tmp_path)
    for step in (1, 2, 3):
        log.write({"kind": "train", "step": step, "loss": 1.0})
    with open(log.path, "a") as f:
        f.write('{"kind": "train", "st')
    assert [r["step"] for r in log.read()] == [1, 2, 3]
    log.truncate_after(2)
    assert [json.loads(l)["step"] for l in log.path.read_text().splitlines()] == [1, 2]
    log.path.write_text('{"kind": "train", "st\n{"kind": "train", "step": 1}\n')
    with pytest.raises(TrainError, match="metrics.jsonl:1"):
        log.read()


def test_token_cache_temp_names_are_per_process(tmp_path, monkeypatch):
    """Ranks of one torchrun job fill a fresh cache at once: their temp files must not collide."""
    from k3.text.tokenizer import special_ids, train_tokenizer
    from k3.train import packing

    texts = ["one document", "another document"]
    tok = train_tokenizer(texts, 300)
    ids = special_ids(tok)
    seen = []
    real_save = packing.np.save
    monkeypatch.setattr(packing.np, "save", lambda path, arr: (seen.append(Path(path).name), real_save(path, arr)))
    stream = packing.cached_token_stream(tmp_path, tok, texts, ids["bos"], ids["eos"])
    assert seen and all(f".{os.getpid()}.tmp" in name for name in seen), seen
    cached = packing.cached_token_stream(tmp_path, tok, texts, ids["bos"], ids["eos"])
    assert (cached.tokens == stream.tokens).all()
    assert not [p for p in tmp_path.rglob("*") if ".tmp" in p.name]


def test_a_damaged_token_cache_entry_is_rebuilt(tmp_path):
    from k3.text.tokenizer import special_ids, train_tokenizer
    from k3.train import packing

    texts = ["one document", "another document"]
    tok = train_tokenizer(texts, 300)
    ids = special_ids(tok)
    stream = packing.cached_token_stream(tmp_path, tok, texts, ids["bos"], ids["eos"])
    (cached,) = tmp_path.rglob("tokens.npy")
    cached.write_bytes(cached.read_bytes()[:40])  # truncated
    again = packing.cached_token_stream(tmp_path, tok, texts, ids["bos"], ids["eos"])
    assert (again.tokens == stream.tokens).all() and (packing.np.load(cached) == stream.tokens).all()


def test_failed_setup_shuts_the_process_group_down(tmp_path, monkeypatch):
    """An error after init_world (here: an unknown preset) must not leave a process group behind."""
    from k3.train import trainer as trainer_mod

    calls = []
    monkeypatch.setattr(trainer_mod, "shutdown", lambda world: calls.append(world))
    with pytest.raises(TrainError, match="unknown preset"):
        Trainer(TrainSettings(config="k3-huge", out=str(tmp_path / "run")), progress=False, log=quiet)
    assert len(calls) == 1 and not (tmp_path / "run").exists()


def test_copy_share_adds_copy_documents_to_training_only(tmp_path):
    from k3.data.copy_corpus import copy_documents
    from k3.data.corpus import load_documents

    corpus = load_documents()[:3]
    docs = copy_documents(corpus, 0.4, seed=1)
    size = sum(len(d.text) for d in docs)
    assert 0.4 <= size / (size + sum(len(d.text) for d in corpus)) < 0.45
    line = docs[0].text.split("\n")
    assert line[0] == line[1] and len(line[0].split()) >= 3  # each sequence shown twice
    assert [d.text for d in copy_documents(corpus, 0.4, seed=1)] == [d.text for d in docs]
    assert copy_documents(corpus, 0.0) == []
    trainer = Trainer(tiny_settings(tmp_path, "copy", copy_share=0.3, steps=1), progress=False, log=quiet)
    plain = Trainer(tiny_settings(tmp_path, "plain", steps=1), progress=False, log=quiet)
    try:
        assert len(trainer.train_data.tokens) > 1.2 * len(plain.train_data.tokens)
    finally:
        trainer.close()
        plain.close()
    with pytest.raises(TrainError, match="copy share must be in"):
        Trainer(tiny_settings(tmp_path, "bad", copy_share=1.0), progress=False, log=quiet)
