"""A stand-in model for serving tests: same cache interface as K3ForCausalLM, exact integer math.

Its next token is a known function of the whole prefix, computed THROUGH the decode state
(KDA-like recurrent sums and conv tails, MLA-like latent rows), so any state the engine restores
wrongly (a bad page, a stale snapshot, a wrong copy) changes the output. Values stay small
integers, exact in fp32.
"""
from __future__ import annotations

import torch
from torch import nn

from k3.config import load_config
from tests.helpers.threads import one_torch_thread  # noqa: F401 (serving tests import it from here)

VOCAB = 61


def fake_config(vocab_size: int = VOCAB):
    # 4 layers: KDA, KDA, KDA, MLA (K3's schedule), tiny state sizes
    return load_config("k3-tiny").replace(num_hidden_layers=4, kda_layers=[1, 2, 3], full_attn_layers=[4],
                                          vocab_size=vocab_size, kda_num_heads=1, kda_head_dim=2,
                                          kv_lora_rank=4, qk_rope_head_dim=2)


def reference_next(prefix: list[int]) -> int:
    """What FakeModel predicts after `prefix`."""
    kda = sum(prefix) % 9973  # recurrent state value per KDA layer
    tail = prefix[-3:]  # conv window W-1 = 3
    mla = sum((i % 7) * t for i, t in enumerate(prefix)) % 9973
    return (3 * kda + 5 * sum(tail) + 7 * mla + len(prefix)) % VOCAB


def reference_generate(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(reference_next(seq))
    return seq[len(prompt):]


class FakeModel(nn.Module):
    def __init__(self, vocab_size: int = VOCAB):
        super().__init__()
        self.config = fake_config(vocab_size)
        self.anchor = nn.Parameter(torch.zeros(1))  # gives the runner a device and dtype

    def forward(self, input_ids, *, cu_seqlens=None, cache=None, logits_to_keep=None):
        assert cache is not None
        shape = input_ids.shape
        if cu_seqlens is None:  # a uniform batch [N, T]: the same as N packed sequences of T
            cu_seqlens = torch.arange(0, input_ids.numel() + 1, shape[1])
            input_ids = input_ids.reshape(1, -1)
        assert input_ids.shape[0] == 1
        bounds = cu_seqlens.tolist()
        logits = torch.zeros(1, input_ids.shape[1], self.config.vocab_size)
        for n in range(len(bounds) - 1):
            for pos in range(bounds[n], bounds[n + 1]):
                t = float(input_ids[0, pos])
                for layer in cache.layers:
                    if hasattr(layer, "recurrent"):
                        layer.recurrent[n] = (layer.recurrent[n] + t) % 9973
                        layer.conv[n] = torch.cat([layer.conv[n][:, 1:], torch.full_like(layer.conv[n][:, :1], t)], 1)
                    else:
                        length = int(layer.lengths[n])
                        layer.reserve(length + 1)
                        layer.buffer[n, length] = t
                        layer.buffer[n, length, 0] = length % 7
                        layer.lengths[n] += 1
                kda_layer = next(layer for layer in cache.layers if hasattr(layer, "recurrent"))
                mla_layer = next(layer for layer in cache.layers if hasattr(layer, "buffer"))
                lat = mla_layer.rows(n)
                kda = int(kda_layer.recurrent[n, 0, 0, 0])
                tail = int(kda_layer.conv[n, 0].sum())
                mla = int((lat[:, 0] * lat[:, 1]).sum()) % 9973
                logits[0, pos, self.predict(lat[:, 1].long().tolist(), kda, tail, mla)] = 1.0
        cache.lengths += torch.tensor(cu_seqlens.diff().tolist())
        logits = logits.view(*shape, -1)
        return logits if logits_to_keep is None else logits[:, logits_to_keep]

    def predict(self, history: list[int], kda: int, tail: int, mla: int) -> int:
        return (3 * kda + 5 * tail + 7 * mla + len(history)) % VOCAB


class ScriptedModel(FakeModel):
    """Replies with a token script after the last `marker` token, then `end`: lets the server tests
    see tool calls and reasoning come out. `script` may be a function of the history (the prompt so
    far), e.g. to answer a tool result differently from a question."""

    def __init__(self, vocab_size: int, marker: int, script, end: int):
        super().__init__(vocab_size)
        self.marker, self.script, self.end = marker, script, end

    def predict(self, history, kda, tail, mla) -> int:
        last = max((i for i, t in enumerate(history) if t == self.marker), default=-1)
        since = len(history) - 1 - last
        script = self.script(history[:last + 1]) if callable(self.script) else self.script
        return script[since] if since < len(script) else self.end


def chat_script(tokenizer, reply: dict) -> list[int]:
    """What a model emits after a chat prompt's last `<|end_of_msg|>` to give `reply` (an assistant
    message): the generation prompt (already in the prompt, so never sampled) then the reply."""
    from k3.text.xtml import XTML

    chat = XTML(tokenizer)
    asked = [{"role": "user", "content": "q"}]
    prompt = chat.render(asked).token_ids
    full = chat.render(asked + [reply], add_generation_prompt=False).token_ids
    last = max(i for i, t in enumerate(prompt) if t == chat.end_of_msg)
    return prompt[last + 1:] + full[len(prompt):]


def scripted_chat_model(tokenizer, reply, after_tool: dict | None = None) -> ScriptedModel:
    """A chat model that always answers `reply` (an assistant message or plain text), or
    `after_tool` when the last message of the prompt is a tool result."""
    from k3.text.xtml import XTML

    chat = XTML(tokenizer)
    reply = {"role": "assistant", "content": reply} if isinstance(reply, str) else reply
    first = chat_script(tokenizer, reply)
    then = chat_script(tokenizer, after_tool) if after_tool else first

    def script(history: list[int]) -> list[int]:
        ends = [i for i, t in enumerate(history) if t == chat.end_of_msg]
        last_message = tokenizer.decode(history[ends[-2] + 1 if len(ends) > 1 else 0:])
        return then if last_message.startswith('message role="tool"') else first

    return ScriptedModel(tokenizer.get_vocab_size(), chat.end_of_msg, script, chat.end_of_msg)


class PoisonModel(FakeModel):
    """FakeModel whose logits are NaN for every sequence whose history holds `poison`: a model gone
    bad on one input, to check that a request whose sampling fails fails alone."""

    def __init__(self, vocab_size: int = VOCAB, poison: int = VOCAB - 1):
        super().__init__(vocab_size)
        self.poison = poison

    def forward(self, input_ids, *, cu_seqlens=None, cache=None, logits_to_keep=None):
        logits = super().forward(input_ids, cu_seqlens=cu_seqlens, cache=cache)
        flat = logits.view(1, -1, logits.shape[-1])  # packed [1, T, V] or uniform [N, 1, V]: positions in order
        bounds = (torch.arange(0, input_ids.numel() + 1, input_ids.shape[1]) if cu_seqlens is None
                  else cu_seqlens).tolist()
        mla = next(layer for layer in cache.layers if hasattr(layer, "buffer"))
        for n in range(len(bounds) - 1):
            if self.poison in mla.rows(n)[:, 1].long().tolist():
                flat[0, bounds[n]:bounds[n + 1]] = float("nan")
        return logits if logits_to_keep is None else logits[:, logits_to_keep]

    def predict(self, history, kda, tail, mla) -> int:  # never the poison itself: healthy requests stay so
        token = super().predict(history, kda, tail, mla)
        return token if token != self.poison else (token + 1) % self.config.vocab_size
