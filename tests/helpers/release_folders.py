"""Folders laid out file-for-file like the Kimi releases as downloaded, at toy size: config.json in
the official dialect (tests/fixtures), tiny random safetensors, a synthetic `tiktoken.model` of a
couple of thousand ranks with the release's special-token block after it, tokenizer_config.json,
generation_config.json and, for Kimi-Linear-Instruct, its chat template.

The special tokens sit at the release's offsets from the end of the ranks (163584 = [BOS] on the
released 163,584-rank table; here ranks + 0): Kimi-Linear's (the K2 family's) named tokens as their
tokenizer_config.json lists them, K3's as public ports of moonshotai/Kimi-K3 read them off its
tokenizer_config.json (bos [BOS], eos [EOS], <|end_of_msg|> the model's eos).
"""
from __future__ import annotations

import base64
import json
from functools import lru_cache
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from k3.checkpoint.official import save_pretrained
from k3.config import K3Config
from k3.model.transformer import K3ForCausalLM
from k3.text import tiktoken_folder as tf
from tests.helpers import K3_CONFIG_JSON, KIMI_LINEAR_CONFIG_JSON

# offset from the end of the ranks -> token (Kimi-Linear-48B-A3B-Instruct's tokenizer_config.json)
KIMI_LINEAR_SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
                        6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
                        11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
                        14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>",
                        254: "[UNK]", 255: "[PAD]"}
# the same for moonshotai/Kimi-K3: XTML's four markers, and <|end_of_msg|> is config.json's eos
K3_SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>",
               6: "[start_header_id]", 7: "[end_header_id]", 9: "[EOT]", 18: "<|media_begin|>",
               19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>", 254: "[UNK]", 255: "[PAD]"}

# Kimi-Linear-Instruct's chat format (its tokenizer_config.json `chat_template`, the K2 family's):
# a tool_declare system turn, a default system turn when the conversation has none, each message
# `<|im_ROLE|>NAME<|im_middle|>CONTENT<|im_end|>`, calls in Kimi's tool-call section, tool results
# under `## Return of ID`, and `<|im_assistant|>assistant<|im_middle|>` as the generation prompt.
# Written here from that format (the release's file itself is not in reach of these tests).
KIMI_LINEAR_TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>"
    "{%- endif -%}"
    "{%- set role = message['role'] -%}"
    "{%- if role == 'user' -%}<|im_user|>{%- elif role == 'assistant' -%}<|im_assistant|>"
    "{%- else -%}<|im_system|>{%- endif -%}"
    "{{- message.get('name') or role -}}<|im_middle|>"
    "{%- if role == 'assistant' and message.get('tool_calls') -%}"
    "{{- message.get('content') or '' -}}<|tool_calls_section_begin|>"
    "{%- for call in message['tool_calls'] -%}"
    "<|tool_call_begin|>{{ call['id'] }}<|tool_call_argument_begin|>"
    "{%- if call['function']['arguments'] is string -%}{{ call['function']['arguments'] }}"
    "{%- else -%}{{ call['function']['arguments'] | tojson }}{%- endif -%}<|tool_call_end|>"
    "{%- endfor -%}<|tool_calls_section_end|>"
    "{%- elif role == 'tool' -%}## Return of {{ message['tool_call_id'] }}\n{{ message['content'] }}"
    "{%- elif message['content'] is string -%}{{ message['content'] }}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}{{ part['text'] }}{%- endfor -%}"
    "{%- endif -%}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)

TEXT = ("The quick brown fox jumps over the lazy dog. What is the weather in Paris today? It is sunny. "
        "日本語のテキスト 中文分词 🙂 def f(x):\n    return x ** 2\n 12345 ") * 40


@lru_cache(maxsize=1)
def ranks() -> tuple[tuple[bytes, int], ...]:
    """About 1,500 tiktoken ranks: the 256 bytes, then a small BPE's merges in order."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=1500, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tuple(tf.ranks_from_bpe(bpe).items())


def write_tokenizer(folder: Path, specials: dict[int, str], *, eos: str, chat_template: str | None = None) -> int:
    """tiktoken.model + tokenizer_config.json (the release's fields); returns the number of ranks."""
    table = dict(ranks())
    n = len(table)
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(table.items(), key=lambda kv: kv[1])]
    (folder / tf.TIKTOKEN_FILE).write_text("\n".join(lines) + "\n")
    config = {"added_tokens_decoder": {str(n + off): {"content": text, "lstrip": False, "normalized": False,
                                                      "rstrip": False, "single_word": False, "special": True}
                                       for off, text in specials.items()},
              "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
              "bos_token": "[BOS]", "eos_token": eos, "pad_token": "[PAD]", "unk_token": "[UNK]",
              "clean_up_tokenization_spaces": False, "model_max_length": 1048576,
              "tokenizer_class": "TikTokenTokenizer"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / tf.TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2))
    return n


def _model(config_json: Path, n: int, eos_offset: int, **changes) -> K3ForCausalLM:
    cfg = K3Config.from_json(config_json)
    small = {"hidden_size": 32, "num_hidden_layers": 4, "kda_layers": [1, 2, 3], "full_attn_layers": [4],
             "num_attention_heads": 2, "num_key_value_heads": 2, "kda_num_heads": 2, "kda_head_dim": 16,
             "num_experts": 4, "num_experts_per_token": 2, "moe_intermediate_size": 16, "intermediate_size": 32,
             "q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
             "vocab_size": n + tf.NUM_RESERVED_SPECIAL_TOKENS, "bos_token_id": n, "eos_token_id": n + eos_offset,
             "pad_token_id": n + 255}
    torch.manual_seed(0)
    return K3ForCausalLM(cfg.replace(**{**small, **changes})).eval()


def kimi_linear_folder(folder: Path, *, generation: dict | None = None) -> Path:
    """moonshotai/Kimi-Linear-48B-A3B-Instruct's layout: config.json, model-*.safetensors + index,
    tiktoken.model, tokenizer_config.json (with the chat template), generation_config.json, and the
    remote-code files k3 never runs (stubs here)."""
    folder.mkdir(parents=True, exist_ok=True)
    n = write_tokenizer(folder, KIMI_LINEAR_SPECIALS, eos="[EOS]", chat_template=KIMI_LINEAR_TEMPLATE)
    save_pretrained(_model(KIMI_LINEAR_CONFIG_JSON, n, 2), folder)
    gen = {"bos_token_id": n, "eos_token_id": [n + 2, n + 1], "do_sample": False, "max_new_tokens": 64}
    (folder / "generation_config.json").write_text(json.dumps(generation or gen))
    for name in ("tokenization_kimi.py", "configuration_kimi.py", "modeling_kimi.py"):
        (folder / name).write_text("raise RuntimeError('remote code must never run inside k3')\n")
    return folder


def k3_folder(folder: Path) -> Path:
    """moonshotai/Kimi-K3's text side: the multimodal config.json (vision tensors absent: the text
    model is served), tiktoken.model, tokenizer_config.json, generation_config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    n = write_tokenizer(folder, K3_SPECIALS, eos="[EOS]")
    save_pretrained(_model(K3_CONFIG_JSON, n, 2), folder)
    config = json.loads((folder / "config.json").read_text())  # the wrapper's own ids, as the release has them
    config.update(bos_token_id=n, eos_token_id=n + 2, pad_token_id=n + 255, media_placeholder_token_id=n + 21)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": n + 2, "temperature": 1.0}))
    return folder
