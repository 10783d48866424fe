"""A folder's own Jinja chat template as a chat format (Kimi-Linear-Instruct's `<|im_user|>` /
`<|im_assistant|>` / `<|im_middle|>` / `<|im_end|>`, or any other), where the tokenizer has no K3
chat markers (those folders render with XTML, k3/text/xtml.py).

The template runs in the sandboxed Jinja environment transformers' `apply_chat_template` uses
(`ImmutableSandboxedEnvironment`, trim_blocks, lstrip_blocks, loop controls, its `tojson`,
`raise_exception` and `strftime_now`), never in Python from the folder. The rendered string becomes
ids as transformers tokenizes it (special-token text -> that special id, the text between -> BPE),
with one difference: special-token text inside a message or tool stays text, so a user cannot forge
a marker (XTML's rule). The loss mask and turn boundaries come from rendering prefixes of the
conversation: an assistant message's tokens are what `messages[:i+1]` adds to `messages[:i]` with
the generation prompt, which needs a template that renders each prefix as a prefix of the whole.
"""
from __future__ import annotations

import itertools
import json
import re
import secrets
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from k3.text.template_reply import TemplateReplyParser, tool_marker_ids
from k3.text.tokenizer import encode_texts
from k3.text.xtml import Rendered, _token_bytes
from k3.text.xtml_parser import Reply


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' override: Jinja's own tojson escapes HTML characters
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    """The template compiled in transformers' sandbox; ValueError in one line if it does not parse."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse (line {e.lineno}: {e.message})") from None


class TemplateChat:
    """Render (messages -> ids, loss mask, boundaries) and parse replies with a folder's template.
    `special_tokens_map`: bos_token, eos_token, ... as the template sees them; `stop_ids`: the ids
    that end a reply (the template's end-of-turn token and the eos ids)."""

    def __init__(self, tokenizer: Tokenizer, template: str, *, end_of_turn: int, stop_ids: tuple[int, ...],
                 special_tokens_map: dict[str, str] | None = None, where: str = "chat template"):
        self.tokenizer, self.source, self.where = tokenizer, template, where
        self.template = compile_template(template)
        self.special_tokens_map = dict(special_tokens_map or {})
        self.end_of_msg = end_of_turn  # the engine's per-request eos (XTML's name for it)
        self.stop_ids = tuple(dict.fromkeys((end_of_turn, *stop_ids)))
        self.eos = next((i for i in self.stop_ids if i != end_of_turn), end_of_turn)
        self.token_bytes = _token_bytes(tokenizer)
        self.tool_markers = tool_marker_ids(tokenizer, template)
        specials = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        self._special_ids = specials
        self._special_re = (re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))
                            if specials else None)

    # ---- rendering

    def _guard(self, value, nonce: str, kept: list[str]):
        """`value` with special-token text in its strings replaced by placeholders (see module doc)."""
        if isinstance(value, str):
            if self._special_re is None or not self._special_re.search(value):
                return value

            def hide(m: re.Match) -> str:
                kept.append(m.group(0))
                return f"\ue000{nonce}{len(kept) - 1}\ue001"
            return self._special_re.sub(hide, value)
        if isinstance(value, dict):
            return {k: self._guard(v, nonce, kept) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._guard(v, nonce, kept) for v in value]
        return value

    def _text(self, messages: list[dict], tools, add_generation_prompt: bool, kwargs: dict) -> str:
        try:
            return self.template.render(messages=messages, tools=tools or None, documents=None,
                                        add_generation_prompt=add_generation_prompt,
                                        **{**self.special_tokens_map, **kwargs})
        except jinja2.TemplateError as e:  # raise_exception, undefined names, sandbox refusals
            raise ValueError(f"the {self.where} failed to render: {e.message or type(e).__name__}") from None
        except (TypeError, AttributeError, KeyError, IndexError, ValueError) as e:  # a template's own bad step
            raise ValueError(f"the {self.where} failed to render: {type(e).__name__}: {e}") from None

    def render_text(self, messages: list[dict], *, tools: list[dict] | None = None,
                    add_generation_prompt: bool = True, **kwargs) -> str:
        """The rendered string, as transformers' `apply_chat_template(tokenize=False)` gives it."""
        return self._text(list(messages), tools, add_generation_prompt, kwargs)

    def render(self, messages: list[dict], *, tools: list[dict] | None = None, reasoning_effort: str | None = None,
               thinking: bool = True, add_generation_prompt: bool = True, tool_choice=None,
               media: list[list[int]] | None = None) -> Rendered:
        """XTML.render's contract. `reasoning_effort` and `thinking` are K3's options: a folder's own
        template has no such switches and they are ignored; forcing a call (tool_choice "required"
        or named) is not something a template can express, so it is refused."""
        if media is not None:
            raise ValueError("this model's chat template takes no images")
        if tool_choice not in (None, "auto", "none"):
            raise ValueError(f"tool_choice {tool_choice!r} is not supported by this model's chat template; "
                             "use \"auto\" or \"none\"")
        tools = None if tool_choice == "none" else tools
        nonce, kept = secrets.token_hex(6), []
        guarded = self._guard(list(messages), nonce, kept)
        tools_g = self._guard(tools, nonce, kept) if tools else None
        full = self._text(guarded, tools_g, add_generation_prompt, {})
        starts, spans = [], []
        for i in range(1, len(guarded) + (1 if add_generation_prompt else 0)):  # message i (or the prompt) starts
            head = self._text(guarded[:i], tools_g, False, {})
            if head and full.startswith(head):
                starts.append(len(head))
        for i, m in enumerate(guarded):
            if m.get("role") != "assistant":
                continue
            asked = self._text(guarded[:i], tools_g, True, {})
            said = self._text(guarded[:i + 1], tools_g, False, {})
            if not (full.startswith(asked) and full.startswith(said) and len(asked) <= len(said)):
                raise ValueError(f"messages[{i}]: the {self.where} does not render this conversation's prefixes as "
                                 "prefixes of it, so the assistant's tokens cannot be told apart")
            spans.append((len(asked), len(said)))
        cuts = sorted({0, len(full), *starts, *(a for a, _ in spans)})
        pieces: list[tuple[int, str | int]] = []  # (char offset, text or special id)
        for a, b in itertools.pairwise(cuts):
            at = a
            for m in self._special_re.finditer(full, a, b) if self._special_re else ():
                if m.start() > at:
                    pieces.append((at, full[at:m.start()]))
                pieces.append((m.start(), self._special_ids[m.group(0)]))
                at = m.end()
            if at < b:
                pieces.append((at, full[at:b]))
        unhide = re.compile(f"\ue000{nonce}(\\d+)\ue001")
        texts = [unhide.sub(lambda m: kept[int(m.group(1))], p) for _, p in pieces if isinstance(p, str)]
        encoded = iter(encode_texts(self.tokenizer, texts))
        ids: list[int] = []
        mask: list[bool] = []
        token_at: dict[int, int] = {}  # char offset of a piece -> its first token index
        for at, p in pieces:
            token_at.setdefault(at, len(ids))
            new = [p] if isinstance(p, int) else next(encoded)
            train = any(a <= at < b for a, b in spans)
            ids += new
            mask += [train] * len(new)
        boundaries = tuple(sorted({token_at[c] for c in starts if c in token_at and token_at[c] > 0}))
        return Rendered(ids, boundaries, mask, "response" if add_generation_prompt else None, None,
                        bool(tools) and self.tool_markers is not None)

    # ---- parsing

    def parser(self, *, tools: bool = True) -> TemplateReplyParser:
        return TemplateReplyParser(self.token_bytes, self.stop_ids, self.tool_markers, tools)

    def parser_for(self, rendered: Rendered) -> TemplateReplyParser:
        if rendered.opened is None:
            raise ValueError("the prompt was rendered without a generation prompt")
        return self.parser(tools=rendered.tools_offered)

    def parse_reply(self, rendered: Rendered, ids) -> Reply:
        parser = self.parser_for(rendered)
        parser.feed(list(ids))
        parser.finish()
        return parser.reply
