"""Tokenizers as Kimi's releases ship them: `tiktoken.model` (one `base64(token) rank` line per
byte-level BPE token) with `tokenizer_config.json`, read without running the folder's Python code.

The ranks become a `tokenizers` BPE once (cached by the files' hash under the k3 cache), so the
rest of k3 sees the same `Tokenizer` it trains itself: vocab = the ranks (as GPT-2's byte-to-char
map spells bytes), merges = for each multi-byte token the two parts BPE joins last, ordered by
rank, which is tiktoken's rule (join the adjacent pair whose union ranks lowest). Pre-tokenization
is the release's regex, then bytes. Special tokens take the ids after the ranks: the named ones of
`tokenizer_config.json`'s `added_tokens_decoder`, the rest of the reserved block
`<|reserved_token_{id}|>`; typed as text, they stay text (k3.text.tokenizer.prepare).
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import json
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from k3.atomic import write_atomic
from k3.cache_dir import resolve_cache_dir

TIKTOKEN_FILE = "tiktoken.model"
TOKENIZER_CONFIG = "tokenizer_config.json"
NUM_RESERVED_SPECIAL_TOKENS = 256  # the release reserves this many ids after the ranks

# The pre-tokenization regex of Kimi's tokenizer (K2, Kimi-Linear, K3): runs of Han characters,
# words split at case changes outside Han with English contractions, digits in threes,
# punctuation runs, newlines, spaces.
_KIMI_PIECES = (
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
)
KIMI_PATTERN = "|".join(_KIMI_PIECES)


class TiktokenFolderError(ValueError):
    """A tiktoken.model or tokenizer_config.json that cannot be used; the message names the file."""


def _byte_chars() -> dict[int, str]:
    """GPT-2's printable spelling of each byte, which `tokenizers`' ByteLevel expects."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def read_ranks(path: str | Path) -> dict[bytes, int]:
    """tiktoken.model as {token bytes: rank}; TiktokenFolderError naming the line for bad base64, a
    bad rank, a duplicate token or rank, or ranks that are not 0..n-1."""
    path = Path(path)
    ranks: dict[bytes, int] = {}
    seen: dict[int, int] = {}
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise TiktokenFolderError(f"cannot read {path}: {e.strerror or e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2:
            raise TiktokenFolderError(f"{path}:{n}: expected 'base64-token rank', got {line[:60]!r}")
        try:
            token = base64.b64decode(parts[0], validate=True)
            rank = int(parts[1])
        except (binascii.Error, ValueError):
            raise TiktokenFolderError(f"{path}:{n}: not 'base64-token rank': {line[:60]!r}") from None
        if token in ranks:
            raise TiktokenFolderError(f"{path}:{n}: token {token!r} appears twice (first at rank {ranks[token]})")
        if rank in seen:
            raise TiktokenFolderError(f"{path}:{n}: rank {rank} appears twice (first on line {seen[rank]})")
        ranks[token], seen[rank] = rank, n
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TiktokenFolderError(f"{path}: byte-level BPE needs every single byte as a token; {len(missing)} "
                                  f"are missing (e.g. {bytes(missing[:1])!r})")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TiktokenFolderError(f"{path}: ranks are not 0..{len(ranks) - 1} without gaps")
    return ranks


def _last_merge(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes]:
    """The two parts tiktoken's BPE joins last to form `token`: BPE over its bytes with only the
    ranks below its own, which ends in exactly two parts for every token a BPE built."""
    limit = ranks[token]
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        best, at = None, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < limit and (best is None or r < best):
                best, at = r, i
        if best is None:
            break
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    if len(parts) != 2:
        raise TiktokenFolderError(f"token {token!r} (rank {limit}) is not a merge of two lower-ranked tokens")
    return parts[0], parts[1]


def special_tokens(folder: str | Path, num_ranks: int) -> dict[int, str]:
    """{id: text} of the reserved block after the ranks: the names `added_tokens_decoder` gives, the
    rest `<|reserved_token_{id}|>`."""
    path = Path(folder) / TOKENIZER_CONFIG
    named: dict[int, str] = {}
    if path.is_file():
        try:
            config = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TiktokenFolderError(f"{path} is not readable JSON ({e})") from None
        decoder = config.get("added_tokens_decoder", {}) if isinstance(config, dict) else None
        if not isinstance(decoder, dict):
            raise TiktokenFolderError(f"{path}: added_tokens_decoder must be an object of id -> token")
        for key, entry in decoder.items():
            content = entry.get("content") if isinstance(entry, dict) else None
            if not (isinstance(key, str) and key.isdigit() and isinstance(content, str) and content):
                raise TiktokenFolderError(f"{path}: added_tokens_decoder[{key!r}] is not an id with a 'content'")
            i = int(key)
            if i < num_ranks:
                raise TiktokenFolderError(f"{path}: special token {content!r} has id {i}, inside the "
                                          f"{num_ranks} BPE ranks of {TIKTOKEN_FILE}")
            named[i] = content
    count = max([NUM_RESERVED_SPECIAL_TOKENS] + [i - num_ranks + 1 for i in named])
    out = {i: named.get(i, f"<|reserved_token_{i}|>") for i in range(num_ranks, num_ranks + count)}
    if len(set(out.values())) != len(out):
        raise TiktokenFolderError(f"{path}: two special token ids share one text")
    return out


def tokenizer_from_ranks(ranks: dict[bytes, int], specials: dict[int, str], pattern: str = KIMI_PATTERN) -> Tokenizer:
    """The `tokenizers` BPE that encodes exactly as tiktoken does with these ranks and pattern."""
    chars = _byte_chars()

    def spell(token: bytes) -> str:
        return "".join(chars[b] for b in token)

    vocab = {spell(t): r for t, r in ranks.items()}
    merges = [(spell(a), spell(b)) for t, _ in sorted(ranks.items(), key=lambda kv: kv[1]) if len(t) > 1
              for a, b in [_last_merge(ranks, t)]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))  # a piece that is a token is that token, as in tiktoken
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    for i in sorted(specials):  # added in id order, so each lands on its id
        if tok.get_vocab_size() != i:
            raise TiktokenFolderError(f"special token ids must follow the ranks without gaps (id {i})")
        tok.add_special_tokens([AddedToken(specials[i], special=True, normalized=False)])
    tok.encode_special_tokens = True  # typed as text, a special token's text stays text
    return tok


def ranks_from_bpe(tok: Tokenizer) -> dict[bytes, int]:
    """A byte-level `tokenizers` BPE's table as tiktoken ranks: the 256 bytes, then each merge's
    token in merge order (what tiktoken.model holds; its specials are not ranks)."""
    byte_of = {c: b for b, c in _byte_chars().items()}
    ranks = {bytes([b]): b for b in range(256)}
    for merge in json.loads(tok.to_str())["model"]["merges"]:
        a, b = merge if isinstance(merge, list) else merge.split(" ")
        ranks.setdefault(bytes(byte_of[c] for c in a + b), len(ranks))
    return ranks


def _read_cached(path: Path) -> Tokenizer | None:
    """A cached conversion, or None if it is damaged (then it is rebuilt, never trusted)."""
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception:  # noqa: BLE001 (tokenizers reports a damaged file as a bare Exception)
        return None
    tok.encode_special_tokens = True
    return tok


def load_tiktoken_folder(folder: str | Path) -> Tokenizer:
    """The folder's tiktoken.model (+ tokenizer_config.json) as a Tokenizer, converted once and
    cached under the files' hash."""
    folder = Path(folder)
    model = folder / TIKTOKEN_FILE
    try:
        raw = model.read_bytes()
    except OSError as e:
        raise TiktokenFolderError(f"cannot read {model}: {e.strerror or e}") from None
    config = folder / TOKENIZER_CONFIG
    h = hashlib.sha256(f"tiktoken|{tokenizers.__version__}|".encode() + raw)
    if config.is_file():
        h.update(config.read_bytes())
    cached = resolve_cache_dir() / "tokenizers" / f"tiktoken-{h.hexdigest()[:20]}.json"
    tok = _read_cached(cached) if cached.is_file() else None
    if tok is not None:
        return tok
    ranks = read_ranks(model)
    tok = tokenizer_from_ranks(ranks, special_tokens(folder, len(ranks)))
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(cached, lambda tmp: tok.save(str(tmp)))
    except OSError:  # a read-only cache costs a conversion per load, nothing else
        return tok
    return tok
