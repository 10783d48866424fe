"""Byte-level BPE tokenizer (HF `tokenizers`), trained on the training split and saved as
`tokenizer.json` next to every checkpoint.

Special tokens take the first ids, in SPECIAL_TOKENS order, so the model config's bos/eos/pad ids
are 0/1/2 (as in the k3-tiny and k3-1b presets). `<|open|>`, `<|sep|>`, `<|close|>` and
`<|end_of_msg|>` (ids 3-6) are K3's four XTML chat markers (k3/text/xtml.py): every tokenizer k3
trains has them, and `prepare` makes a literal marker string in text encode as text, so user text
can never forge one.
Byte-level means every token is a whole number of bytes and each character of a token's string is
exactly one byte, so `token_bytes` gives the UTF-8 length of any token span (bits per byte).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from k3.atomic import write_atomic, write_text_atomic
from k3.text.tiktoken_folder import TIKTOKEN_FILE, load_tiktoken_folder

SPECIAL_TOKENS = {
    "bos": "<|bos|>",
    "eos": "<|eos|>",
    "pad": "<|pad|>",
    "open": "<|open|>",
    "sep": "<|sep|>",
    "close": "<|close|>",
    "end_of_msg": "<|end_of_msg|>",
}
CHAT_MARKERS = ("open", "sep", "close", "end_of_msg")
TOKENIZER_FILE = "tokenizer.json"
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256  # the specials and one token per byte


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE with exactly `vocab_size` ids at most (fewer if the text runs out of merges)."""
    minimum = MIN_VOCAB_SIZE
    if vocab_size < minimum:
        raise ValueError(f"vocab size must be >= {minimum} (specials + 256 byte tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    prepare(tok)
    return tok


def prepare(tok: Tokenizer) -> Tokenizer:
    """Raw text that happens to contain "<|bos|>" etc. is encoded as text, never as a marker."""
    tok.encode_special_tokens = True
    return tok


def special_ids(tok: Tokenizer, names: tuple[str, ...] | None = None) -> dict[str, int]:
    """Ids of the reserved special tokens (all of them, or just `names`); ValueError naming any the
    tokenizer lacks (one trained before a marker was reserved, or not by k3)."""
    ids = {name: tok.token_to_id(SPECIAL_TOKENS[name]) for name in (SPECIAL_TOKENS if names is None else names)}
    missing = [SPECIAL_TOKENS[n] for n, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"tokenizer lacks the reserved special tokens {missing}")
    return ids


def token_bytes(tok: Tokenizer) -> list[int]:
    """UTF-8 bytes each id stands for (0 for special tokens: k3's, or a release's [BOS], <|im_end|>, ...)."""
    specials = set(SPECIAL_TOKENS.values()) | {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    return [0 if (s := tok.id_to_token(i)) in specials or s is None else len(s) for i in range(tok.get_vocab_size())]


def save_tokenizer(tok: Tokenizer, directory: str | Path, *, chat_template: str | None = None) -> Path:
    """tokenizer.json plus a tokenizer_config.json naming the specials (so transformers'
    AutoTokenizer loads the folder too), with `chat_template` when given (the mark of a chat model,
    k3.text.chat_template.CHAT_TEMPLATE); both via temp + rename."""
    directory = Path(directory)
    path = write_atomic(directory / TOKENIZER_FILE, lambda tmp: tok.save(str(tmp)))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL_TOKENS["bos"],
           "eos_token": SPECIAL_TOKENS["eos"], "pad_token": SPECIAL_TOKENS["pad"],
           "additional_special_tokens": [SPECIAL_TOKENS[k] for k in CHAT_MARKERS]}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    write_text_atomic(directory / "tokenizer_config.json", json.dumps(cfg, indent=2) + "\n")
    return path


def load_tokenizer(directory_or_file: str | Path) -> Tokenizer:
    """A folder's tokenizer.json, or the tiktoken.model a Kimi release ships in its place
    (k3/text/tiktoken_folder.py), or a tokenizer.json file."""
    path = Path(directory_or_file)
    if path.is_dir():
        if not (path / TOKENIZER_FILE).is_file() and (path / TIKTOKEN_FILE).is_file():
            return load_tiktoken_folder(path)
        if not (path / TOKENIZER_FILE).is_file():
            raise FileNotFoundError(f"no {TOKENIZER_FILE} or {TIKTOKEN_FILE} in {path}")
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {TOKENIZER_FILE} at {path}")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 (tokenizers reports a damaged file as a bare Exception)
        raise ValueError(f"cannot read {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return prepare(tokenizer)


def tokenizer_fingerprint(texts: list[str], vocab_size: int) -> str:
    """Cache key of a trained tokenizer: inputs, size, specials and the library version."""
    h = hashlib.sha256(f"bpe-bytelevel|{vocab_size}|{tokenizers.__version__}|{sorted(SPECIAL_TOKENS.items())}".encode())
    for t in texts:
        h.update(hashlib.sha256(t.encode()).digest())
    return h.hexdigest()[:16]


def encode_text(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of `text` without special tokens. encode_batch releases the GIL while it works
    (encode holds it), so a long text does not stall a server's event loop."""
    return encode_texts(tokenizer, [text])[0]


def encode_texts(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    """`encode_text` of each text, in one GIL-free batch (a rendered chat is many short texts).
    Text that is not valid Unicode (a lone surrogate from JSON's "\\ud800") is a ValueError."""
    if not texts:
        return []
    try:
        return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    except TypeError:  # tokenizers' complaint about a str it cannot encode to UTF-8
        bad = next((t for t in texts if not _is_utf8(t)), None)
        if bad is None:
            raise
        raise ValueError(f"text is not valid Unicode (a lone surrogate) near {bad[:40]!r}") from None


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False
