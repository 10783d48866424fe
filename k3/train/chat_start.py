"""What a post-training verb (`k3 sft`, `k3 rl`, `k3 distill`) starts from besides the weights: the
run's tokenizer and K3's chat format over it, checked once here for every verb."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from k3.config import K3Config
from k3.model.multimodal import vision_config_of
from k3.text.tokenizer import load_tokenizer
from k3.text.xtml import XTML
from k3.train.errors import TrainError


@dataclass(frozen=True)
class ChatStart:
    tokenizer: Tokenizer
    chat: XTML  # K3's chat format (XTML) over `tokenizer`


def load_chat_start(config: K3Config, tokenizer_from: str | Path, init: str, verb: str, label, hint: str) -> ChatStart:
    """The tokenizer (from `tokenizer_from`) and chat format of a starting model with `config`:
    a text model (a VL checkpoint would lose its tower), a readable tokenizer, K3's chat markers in
    it; TrainError otherwise ("LABEL: why; HINT" for the markers). The caller checks the tokenizer
    fits the model (Trainer._adopt_tokenizer)."""
    if vision_config_of(config) is not None:
        raise TrainError(f"{init} is a vision-language model: {verb} trains text models")
    try:
        tokenizer = load_tokenizer(tokenizer_from)
    except (FileNotFoundError, ValueError) as e:  # a checkpoint saved without it, or a damaged one
        raise TrainError(f"cannot load the tokenizer: {e}") from None
    try:
        chat = XTML(tokenizer)
    except ValueError as e:
        raise TrainError(f"{label}: {e}; {hint}") from None
    return ChatStart(tokenizer, chat)
