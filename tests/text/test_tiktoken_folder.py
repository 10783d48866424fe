"""Kimi's `tiktoken.model` folders (k3/text/tiktoken_folder.py): the converted tokenizer encodes
exactly as the `tiktoken` library does with the same ranks, the release's regex and its special
tokens, on 10,000 generated strings (CJK, emoji, code, digits, whitespace runs, special-token text
typed as text); damaged files are one-line errors naming the file."""
from __future__ import annotations

import base64
import json
import random

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from k3.data.corpus import load_documents
from k3.text import tiktoken_folder as tf
from k3.text.tokenizer import load_tokenizer

tiktoken = pytest.importorskip("tiktoken")

PIECES = ["hello world", "The quick brown fox", "def f(x):\n    return x ** 2\n", "日本語のテキスト", "中文分词测试",
          "한국어 문장", "🙂🚀✨", "👩‍👩‍👧", "12345678", "3.14159", "   \t\n\n", "\r\n", "It's they'll WE'VE", "naïve café",
          "CamelCaseWord", "ALLCAPS lower", "x = {'a': [1, 2]}", "Ελληνικά", "русский текст", "עברית", "مرحبا",
          "[BOS]", "[EOS]", "<|im_end|>", "<|reserved_token_9|>", "  leading", "trailing  ", "a\u0301", "\u200b"]


def mixed(rng: random.Random, n: int) -> list[str]:
    """Strings of random pieces, random code points from several scripts and whitespace runs."""
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 10)):
            kind = rng.random()
            if kind < 0.6:
                parts.append(rng.choice(PIECES))
            elif kind < 0.8:
                lo, hi = rng.choice([(0x20, 0x7E), (0x4E00, 0x9FFF), (0x3040, 0x30FF), (0x1F300, 0x1F6FF), (0xA0, 0x24F)])
                parts.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 6))))
            else:
                parts.append("".join(rng.choice(" \t\n\r") for _ in range(rng.randint(1, 5))))
        out.append("".join(parts))
    return out


@pytest.fixture(scope="module")
def ranks() -> dict[bytes, int]:
    """A few thousand tiktoken ranks from a byte-level BPE trained here: the 256 bytes, then each
    merge's token at the next rank (as a BPE table always is)."""
    text = "".join(d.text for d in load_documents(None)[:3])[:400_000]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=4000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator([text] + mixed(random.Random(7), 2000), trainer=trainer)
    table = tf.ranks_from_bpe(bpe)
    assert len(table) > 2000
    return table


def release_folder(tmp_path, ranks: dict[bytes, int], named: dict[int, str]):
    """A folder laid out as the release's tokenizer files: tiktoken.model + tokenizer_config.json."""
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    (tmp_path / tf.TIKTOKEN_FILE).write_text("\n".join(lines) + "\n")
    config = {"added_tokens_decoder": {str(i): {"content": c, "special": True} for i, c in named.items()},
              "bos_token": "[BOS]", "eos_token": "[EOS]", "tokenizer_class": "TikTokenTokenizer"}
    (tmp_path / tf.TOKENIZER_CONFIG).write_text(json.dumps(config))
    return tmp_path


def test_ids_equal_tiktoken_on_generated_strings(tmp_path, ranks, monkeypatch):
    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path / "cache"))
    n = len(ranks)
    named = {n: "[BOS]", n + 1: "[EOS]", n + 4: "<|im_end|>"}
    (tmp_path / "model").mkdir()
    folder = release_folder(tmp_path / "model", ranks, named)
    tok = load_tokenizer(folder)
    specials = tf.special_tokens(folder, n)
    reference = tiktoken.Encoding("release", pat_str=tf.KIMI_PATTERN, mergeable_ranks=ranks,
                                  special_tokens={text: i for i, text in specials.items()})
    strings = mixed(random.Random(0), 10_000)
    for s in strings:
        ours = tok.encode(s, add_special_tokens=False).ids
        assert ours == reference.encode(s, disallowed_special=()), repr(s)
        assert tok.decode(ours) == s
    assert tok.token_to_id("[BOS]") == n and tok.token_to_id("<|im_end|>") == n + 4
    assert tok.token_to_id(f"<|reserved_token_{n + 2}|>") == n + 2
    assert tok.get_vocab_size() == n + tf.NUM_RESERVED_SPECIAL_TOKENS
    assert list((tmp_path / "cache" / "tokenizers").glob("tiktoken-*.json")), "the conversion is cached"
    assert load_tokenizer(folder).encode(strings[0]).ids == tok.encode(strings[0]).ids  # from the cache


@pytest.mark.parametrize("damage,message", [
    (lambda lines: lines[:5] + ["not*base64 5"] + lines[6:], "not 'base64-token rank'"),
    (lambda lines: lines + [lines[300].split()[0] + f" {len(lines)}"], "appears twice"),
    (lambda lines: lines[:-1] + [lines[-1].split()[0] + " 5"], "rank 5 appears twice"),
    (lambda lines: lines[1:], "every single byte"),
])
def test_damaged_tiktoken_model_is_a_one_line_error(tmp_path, ranks, damage, message):
    folder = release_folder(tmp_path, ranks, {})
    lines = (folder / tf.TIKTOKEN_FILE).read_text().splitlines()
    (folder / tf.TIKTOKEN_FILE).write_text("\n".join(damage(lines)) + "\n")
    with pytest.raises(tf.TiktokenFolderError, match=message) as e:
        tf.read_ranks(folder / tf.TIKTOKEN_FILE)
    assert "\n" not in str(e.value) and tf.TIKTOKEN_FILE in str(e.value)


def test_special_token_inside_the_ranks_contradicts_the_model(tmp_path, ranks):
    folder = release_folder(tmp_path, ranks, {10: "[BOS]"})
    with pytest.raises(tf.TiktokenFolderError, match="inside the"):
        tf.special_tokens(folder, len(ranks))


def test_folder_without_any_tokenizer_names_both_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json.*tiktoken.model"):
        load_tokenizer(tmp_path)
