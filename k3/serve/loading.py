"""What to serve: a `k3 train` run folder (its latest checkpoint) or any HF-layout checkpoint,
a Kimi release as downloaded included, plus its tokenizer, chat format, generation defaults and
whether the model was chat-tuned (k3/text/model_folder.py reads those).

A checkpoint counts as chat-tuned when the tokenizer_config.json beside its tokenizer carries a
`chat_template` (the Hugging Face sign of a chat model, which supervised fine-tuning writes), or the
folder has a chat_template.jinja; a `k3 train` run is pretraining and has none.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import NamedTuple

import torch
from tokenizers import Tokenizer

from k3.checkpoint.multimodal import is_multimodal_checkpoint, load_pretrained_multimodal
from k3.checkpoint.pretrained import load_pretrained
from k3.model.multimodal import MEDIA_PLACEHOLDER_TOKEN_ID
from k3.serve.model_source import checkpoint_folder, tokenizer_path
from k3.text.generation_config import GenerationDefaults
from k3.text.model_folder import load_folder_text
from k3.text.tokenizer import SPECIAL_TOKENS

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def is_chat_tuned(tokenizer_file: Path) -> bool:
    """True when the tokenizer_config.json beside the tokenizer has a chat_template (see above)."""
    try:
        return bool(json.loads((tokenizer_file.parent / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):  # absent, unreadable or not an object: no chat template
        return False


def run_chat_defaults(run: str | None) -> dict:
    """The chat template options a run folder was trained with (its run.json): {"thinking": False}
    for a vision-language run trained without the think channel (`vl_thinking`), else {}. Requests
    that do not say otherwise are then rendered the way the run learned."""
    if run is None:
        return {}
    try:
        settings = json.loads((Path(run) / "run.json").read_text())
    except (OSError, ValueError):
        return {}  # a checkpoint folder, or no run.json: the template's own defaults
    return {"thinking": False} if isinstance(settings, dict) and settings.get("vl_thinking") is False else {}


class Served(NamedTuple):
    model: torch.nn.Module  # in eval mode
    tokenizer: Tokenizer
    name: str  # the served model name: the run's (or checkpoint folder's) name
    chat_tuned: bool
    chat: object = None  # XTML, the folder's TemplateChat, or None (completions only)
    generation: GenerationDefaults = GenerationDefaults()  # generation_config.json's defaults


def check_placeholder(token: int, vocab: int, tokenizer, folder) -> None:
    """The image placeholder must be an id the engine takes and no text token writes: else every
    image request fails, or text is read as image slots (ValueError naming the config)."""
    if token >= vocab:
        raise ValueError(f"{Path(folder) / 'config.json'}: media_placeholder_token_id {token} is outside the "
                         f"vocabulary [0, {vocab}) (an absent one defaults to K3's {MEDIA_PLACEHOLDER_TOKEN_ID}); "
                         "set it to an id no text token uses")
    name = tokenizer.id_to_token(token)
    if name in SPECIAL_TOKENS.values():
        raise ValueError(f"{Path(folder) / 'config.json'}: media_placeholder_token_id {token} is the tokenizer's "
                         f"special token {name!r}; set it to an id no text token uses")


def load_for_serving(run: str | None = None, model: str | None = None, tokenizer: str | None = None,
                     device: str = "cpu", dtype: str = "float32") -> Served:
    """The model, its tokenizer, a served name and whether it was chat-tuned, all read from one
    resolved checkpoint. A missing or corrupted file raises ValueError / OSError naming it."""
    folder = checkpoint_folder(run, model)
    tok_path = tokenizer_path(folder, tokenizer)
    load = load_pretrained_multimodal if is_multimodal_checkpoint(folder) else load_pretrained
    net = load(folder, device=torch.device(device), dtype=DTYPES[dtype]).eval()
    text_config = (net.language_model if hasattr(net, "language_model") else net).config
    try:
        text = load_folder_text(folder, text_config, tok_path)
    except (OSError, ValueError):  # one line each, naming the file
        raise
    except Exception as e:  # noqa: BLE001 (the tokenizers library raises a bare Exception on a malformed file)
        raise ValueError(f"{tok_path} is not a readable tokenizer file ({e})") from None
    tok, vocab = text.tokenizer, text_config.vocab_size
    if tok.get_vocab_size() > vocab:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} ids, the model only {vocab}")
    if hasattr(net, "language_model"):
        check_placeholder(net.config.media_placeholder_token_id, vocab, tok, folder)
    name = Path(run or model).name  # a run folder's name, or the checkpoint folder's
    log.info("serving %s (%s) from %s", name, dtype, folder)
    return Served(net, tok, name, text.chat_tuned, text.chat, text.generation)
