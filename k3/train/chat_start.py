"""What a post-training verb (`k3 sft`, `k3 rl`, `k3 distill`) starts from besides the weights: the
run's tokenizer and its chat format (K3's XTML, or a release folder's own template), checked once
here for every verb."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from k3.config import K3Config
from k3.model.multimodal import vision_config_of
from k3.text.model_folder import is_release_tokenizer, load_folder_text
from k3.text.template_chat import TemplateChat
from k3.text.xtml import XTML
from k3.train.errors import TrainError


@dataclass(frozen=True)
class ChatStart:
    tokenizer: Tokenizer
    chat: XTML | TemplateChat  # K3's chat format (XTML) over `tokenizer`, or the folder's own template
    files_from: Path | None = None  # a release's tokenizer folder: its files are carried, its ids kept


def load_chat_start(config: K3Config, tokenizer_from: str | Path, init: str, verb: str, label, hint: str) -> ChatStart:
    """The tokenizer (from `tokenizer_from`, a folder) and chat format of a starting model with
    `config`: a text model (a VL checkpoint would lose its tower), a readable tokenizer, and K3's
    chat markers in it or a chat template beside it (a Kimi release as downloaded,
    k3/text/model_folder.py); TrainError otherwise ("LABEL: why; HINT" for the markers). The
    caller checks the tokenizer fits the model (Trainer._adopt_tokenizer)."""
    if vision_config_of(config) is not None:
        raise TrainError(f"{init} is a vision-language model: {verb} trains text models")
    try:
        text = load_folder_text(tokenizer_from, config)
    except (FileNotFoundError, ValueError) as e:  # a checkpoint saved without it, or a damaged one
        raise TrainError(f"cannot load the tokenizer: {e}") from None
    if text.chat is None:
        try:
            XTML(text.tokenizer)  # raises, naming the markers it lacks
        except ValueError as e:
            raise TrainError(f"{label}: {e}; {hint}") from None
    return ChatStart(text.tokenizer, text.chat, Path(tokenizer_from) if is_release_tokenizer(tokenizer_from) else None)
