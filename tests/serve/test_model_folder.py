"""Kimi releases as downloaded (tests/helpers/release_folders.py: folders laid out file-for-file like
moonshotai/Kimi-Linear-48B-A3B-Instruct and moonshotai/Kimi-K3, tiny random weights): served to
the unmodified `openai` client with the folder's chat template and generation defaults, generated
from, loaded with `K3ForCausalLM.from_pretrained`, fine-tuned and served again; damaged or
contradicting folders are one-line errors."""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from k3 import K3ForCausalLM
from k3.cli import main
from k3.generation.generate import generate
from k3.serve.api.server import ServerThread, build_app
from k3.serve.engine import AsyncEngine, EngineConfig, LLMEngine
from k3.serve.loading import load_for_serving
from k3.text.template_chat import TemplateChat
from k3.text.xtml import XTML
from tests.helpers.release_folders import k3_folder, kimi_linear_folder
from tests.serve.fakes import one_torch_thread  # noqa: F401 (autouse fixture)

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("releases")
    return kimi_linear_folder(root / "Kimi-Linear-48B-A3B-Instruct"), k3_folder(root / "Kimi-K3")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path / "cache"))


def serve(served):
    """What `k3 serve --model DIR` builds from the loaded folder."""
    engine = LLMEngine(served.model, EngineConfig(block_size=16, hash_block_size=64, max_model_len=512))
    return ServerThread(build_app(AsyncEngine(engine, served.tokenizer), served.tokenizer, model_name=served.name,
                                  chat=served.chat, generation=served.generation))


def test_kimi_linear_instruct_folder_answers_the_openai_client_with_its_defaults(folders):
    served = load_for_serving(model=str(folders[0]))
    assert isinstance(served.chat, TemplateChat) and served.chat_tuned
    assert served.generation.temperature == 0.0  # generation_config.json: do_sample false
    prompt = served.chat.render(ASK)
    expected = generate(served.model, [prompt.token_ids], 6, temperature=0.0, eos_token_id=served.chat.stop_ids)[0]
    reply = served.chat.parse_reply(prompt, expected)
    assert reply.content  # something to compare
    with serve(served) as server:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        name = "Kimi-Linear-48B-A3B-Instruct"
        # no temperature: the folder's greedy default, so both equal the greedy reference (sampled at 1 they would not)
        whole = c.chat.completions.create(model=name, messages=ASK, max_tokens=6)
        assert (whole.choices[0].message.content or "") == reply.content
        assert whole.usage.prompt_tokens == len(prompt.token_ids)
        chunks = list(c.chat.completions.create(model=name, messages=ASK, max_tokens=6, stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == reply.content
        bad = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
            "model": name, "messages": ASK, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "required"})
        assert bad.status_code == 400 and "tool_choice" in bad.json()["error"]["message"]


def test_k3_folder_chats_in_xtml_and_both_load_and_generate(folders, capsys):
    kimi_linear, k3 = folders
    served = load_for_serving(model=str(k3))
    assert isinstance(served.chat, XTML) and served.chat_tuned
    assert served.tokenizer.id_to_token(served.chat.end_of_msg) == "<|end_of_msg|>"
    assert served.tokenizer.id_to_token(served.chat.eos) == "[EOS]"
    for folder in folders:
        model = K3ForCausalLM.from_pretrained(folder)
        assert model.config.vocab_size == served.tokenizer.get_vocab_size()
    with pytest.raises(SystemExit) as done:
        main(["generate", "--model", str(kimi_linear), "--prompt", "The quick", "--max-tokens", "3"])
    assert done.value.code in (0, None) and capsys.readouterr().out.startswith("The quick")


def test_k3_chat_on_the_release_folder(folders, capsys, monkeypatch):
    from tests.serve.test_chat_cli import chat

    code, out, err = chat(capsys, monkeypatch, ["--model", str(folders[0]), "--max-tokens", "3"], ["hello", ""])
    assert code == 0 and not err and "not been chat-tuned" not in out
    assert [line for line in out.splitlines() if line.startswith("[stopped:")]


def _damage(folder, how: str) -> None:
    if how == "no tokenizer":
        (folder / "tiktoken.model").unlink()
    elif how == "bad base64":
        lines = (folder / "tiktoken.model").read_text().splitlines()
        (folder / "tiktoken.model").write_text("\n".join(["not*base64 0", *lines[1:]]) + "\n")
    elif how == "duplicate rank":
        lines = (folder / "tiktoken.model").read_text().splitlines()
        (folder / "tiktoken.model").write_text("\n".join([*lines, f"{lines[-1].split()[0]} {len(lines)}"]) + "\n")
    elif how == "eos contradicts":
        config = json.loads((folder / "config.json").read_text())
        config["eos_token_id"] = 40
        (folder / "config.json").write_text(json.dumps(config))
    elif how == "template fails":
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = "{% for m in messages %}"
        (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("how,message", [
    ("no tokenizer", "no tokenizer.json or tiktoken.model in"), ("bad base64", "not 'base64-token rank'"),
    ("duplicate rank", "appears twice"), ("eos contradicts", "eos_token_id 40 is"),
    ("template fails", "chat template does not parse"),
])
def test_damaged_or_contradicting_folders_are_one_line_errors(folders, tmp_path, capsys, how, message):
    folder = shutil.copytree(folders[0], tmp_path / "model")
    _damage(folder, how)
    with pytest.raises(SystemExit) as done:
        main(["serve", "--model", str(folder)])
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("k3: ")]
    assert done.value.code == 2 and len(err) == 1 and message in err[0], err


def _k3_serve(folder):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "k3", "serve", "--model", str(folder), "--port", str(port),
                             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stdout.read().decode()
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "k3 serve did not come up"
        time.sleep(0.2)


@pytest.mark.slow
def test_sft_on_the_release_folder_saves_its_layout_and_serves_again(folders, tmp_path):
    """`k3 sft --model DIR`, then `k3 serve --model CHECKPOINT` as a real process."""
    from k3.sft.trainer import SFTSettings, SFTTrainer
    from tests.helpers.train import quiet

    data = tmp_path / "chats.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                          {"role": "assistant", "content": f"{i} + {i} is {2 * i}."}]} for i in range(12)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = SFTSettings(init=str(folders[0]), data=str(data), out=str(tmp_path / "sft"), steps=2, batch_size=2,
                           seq_len=256, eval_every=2, ckpt_every=2, agent_episodes=0, cache_dir=str(tmp_path / "c"))
    trainer = SFTTrainer(settings, progress=False, log=quiet)
    try:
        result = trainer.train()
    finally:
        trainer.close()
    ckpt = result["checkpoint"]
    names = {p.name for p in __import__("pathlib").Path(ckpt).iterdir()}
    assert {"tiktoken.model", "tokenizer_config.json", "generation_config.json", "tokenization_kimi.py"} <= names
    assert "tokenizer.json" not in names
    assert json.loads((folders[0] / "config.json").read_text())["model_type"] == \
        json.loads((__import__("pathlib").Path(ckpt) / "config.json").read_text())["model_type"]
    proc, url = _k3_serve(ckpt)
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        name = c.models.list().data[0].id
        out = c.chat.completions.create(model=name, messages=ASK, max_tokens=4)
        assert out.usage.completion_tokens <= 4
        streamed = list(c.chat.completions.create(model=name, messages=ASK, max_tokens=4, stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == \
            (out.choices[0].message.content or "")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
