"""The text side of a checkpoint folder as k3 writes it or as a Kimi release is downloaded: its
tokenizer (tokenizer.json, or tiktoken.model + tokenizer_config.json), its chat format and its
generation defaults, checked against its config.json. Nothing from the folder is executed.

The chat format: a tokenizer with K3's chat markers renders with XTML (k3 runs, the K3 release,
whose own encoder is XTML); any other folder with a Jinja chat template (tokenizer_config.json's
`chat_template`, or chat_template.jinja) renders with that template (k3/text/template_chat.py),
e.g. Kimi-Linear-Instruct; with neither there is no chat format (completions only). A folder counts
as chat-tuned when it carries a chat template, or is a release whose tokenizer has K3's markers.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from k3.atomic import write_atomic
from k3.text.generation_config import GENERATION_CONFIG, GenerationDefaults, read_generation_config, read_json_object
from k3.text.template_chat import TemplateChat
from k3.text.tiktoken_folder import TIKTOKEN_FILE, TOKENIZER_CONFIG
from k3.text.tokenizer import TOKENIZER_FILE, load_tokenizer
from k3.text.xtml import XTML

CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")
# a release's text files, carried over (with its *.py remote code) when a model trained from it is saved
CARRIED_FILES = (TIKTOKEN_FILE, TOKENIZER_CONFIG, CHAT_TEMPLATE_FILE, GENERATION_CONFIG, "special_tokens_map.json")


def read_tokenizer_config(folder: str | Path) -> dict:
    path = Path(folder) / TOKENIZER_CONFIG
    return read_json_object(path) if path.is_file() else {}


def chat_template_of(folder: str | Path) -> str | None:
    """tokenizer_config.json's `chat_template` (a string, or transformers' list of named templates:
    the "default" one), else chat_template.jinja, else None."""
    folder = Path(folder)
    template = read_tokenizer_config(folder).get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{folder / TOKENIZER_CONFIG}: chat_template must be a string")
    if template is None and (folder / CHAT_TEMPLATE_FILE).is_file():
        template = (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    return template or None


def special_tokens_map(folder: str | Path) -> dict[str, str]:
    """bos_token, eos_token, ... as tokenizer_config.json names them (a string or {"content": ...})."""
    out = {}
    for key, value in read_tokenizer_config(folder).items():
        if key in TOKEN_NAMES:
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                out[key] = value
    return out


def check_against_config(tokenizer: Tokenizer, folder: str | Path, config) -> None:
    """A release's tokenizer (tiktoken.model) must fit its config.json: no more ids than
    vocab_size, and bos / eos / pad ids that are the tokenizer's special tokens (ValueError in one
    line naming both files). k3's own run folders are checked by the verbs that write them."""
    folder = Path(folder)
    if not (folder / TIKTOKEN_FILE).is_file():
        return
    where = f"{folder / TOKENIZER_CONFIG} contradicts {folder / 'config.json'}"
    if tokenizer.get_vocab_size() > config.vocab_size:
        raise ValueError(f"{where}: the tokenizer has {tokenizer.get_vocab_size()} ids, vocab_size is {config.vocab_size}")
    specials = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        i = getattr(config, name, None)
        if i is not None and i not in specials:
            raise ValueError(f"{where}: {name} {i} is {tokenizer.id_to_token(i)!r}, not one of the tokenizer's "
                             "special tokens")
    for key, text in special_tokens_map(folder).items():
        if tokenizer.token_to_id(text) is None:
            raise ValueError(f"{folder / TOKENIZER_CONFIG}: {key} {text!r} is not a token of {TIKTOKEN_FILE}")


def chat_format(tokenizer: Tokenizer, folder: str | Path, generation: GenerationDefaults, eos_token_id: int | None):
    """XTML, the folder's TemplateChat, or None (see the module docstring)."""
    try:
        return XTML(tokenizer)
    except ValueError:
        pass
    template = chat_template_of(folder)
    if template is None:
        return None
    names = special_tokens_map(folder)
    eos = tokenizer.token_to_id(names["eos_token"]) if "eos_token" in names else None
    ends = [i for i in (eos_token_id, *generation.eos_token_ids, eos) if i is not None]
    if not ends:
        raise ValueError(f"{Path(folder) / 'config.json'}: no eos_token_id to end a chat reply with")
    where = f"chat template of {Path(folder) / TOKENIZER_CONFIG}"
    return TemplateChat(tokenizer, template, end_of_turn=ends[0], stop_ids=tuple(ends), special_tokens_map=names,
                        where=where)


@dataclass(frozen=True)
class FolderText:
    tokenizer: Tokenizer
    chat: object  # XTML | TemplateChat | None
    generation: GenerationDefaults
    chat_tuned: bool


def load_folder_text(folder: str | Path, config, tokenizer_from: str | Path | None = None) -> FolderText:
    """The tokenizer (from `tokenizer_from`, a folder or a tokenizer.json, default the checkpoint
    folder), chat format and generation defaults of a checkpoint with text `config`. Errors are
    ValueError / FileNotFoundError in one line."""
    folder = Path(folder)
    source = Path(tokenizer_from) if tokenizer_from else folder
    tokenizer = load_tokenizer(source)
    tok_folder = source if source.is_dir() else source.parent
    check_against_config(tokenizer, tok_folder, config)
    generation = read_generation_config(folder)
    chat = chat_format(tokenizer, tok_folder, generation, config.eos_token_id)
    # a release whose tokenizer holds K3's chat markers is the chat model Moonshot published
    tuned = chat_template_of(tok_folder) is not None or isinstance(chat, XTML) and is_release_tokenizer(tok_folder)
    return FolderText(tokenizer, chat, generation, tuned)


def carry_tokenizer_files(source: str | Path, target: str | Path) -> None:
    """Copy a release folder's tokenizer, chat template, generation config and remote-code (*.py)
    files into `target`, each via temp + rename; transformers with the release's code reads the copy."""
    source, target = Path(source), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.iterdir()):
        if path.is_file() and (path.name in CARRIED_FILES or path.suffix == ".py"):
            write_atomic(target / path.name, lambda tmp, p=path: shutil.copyfile(p, tmp))


def is_release_tokenizer(folder: str | Path) -> bool:
    """A tiktoken.model folder without k3's tokenizer.json (its files are carried, not rewritten)."""
    folder = Path(folder)
    return (folder / TIKTOKEN_FILE).is_file() and not (folder / TOKENIZER_FILE).is_file()
