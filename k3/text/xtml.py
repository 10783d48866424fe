"""K3's XTML chat format: the one renderer (messages -> token ids, loss mask, turn boundaries) and the
one incremental parser (reply token ids -> reasoning / content / tool calls), shared by SFT
masking, the server and `k3 chat`.

Four special tokens structure a conversation; tag names and attributes are ordinary text:
    <|open|>message role="user"<|sep|>TEXT<|close|>message<|sep|><|end_of_msg|>
Markers are token ids, inserted by the renderer and matched by id in the parser, never found in
text: a user typing "<|open|>" gets text tokens (the tokenizer's `prepare`), and the parser never
sees a marker there.

The format follows Moonshot's `encoding_k3.py` (moonshotai/Kimi-K3 on Hugging Face), read through
public copies and ports, since the file itself is not in reach here:
  [enc]   vllm-project/vllm vllm/tokenizers/encoding_k3.py: a copy of `build_chat_segments` whose
          header names the HF file as its source.
  [asc]   vllm-project/vllm-ascend vllm_ascend/patch/platform/patch_kimi_k3_renderer.py (OpenAI
          request fields -> encoder arguments) and .../kimi_k3_xtml.py (its strict reply parser).
  [ports] golden strings of a Rust port (rabbit's `kimi_k3` template), SGLang model gateway's
          Rust port of `build_chat_segments`, NVIDIA dynamo's K3 reply renderer.
Decisions, each with its source:
  - Order: a `tool-declare` system message (when tools are offered), then the `thinking-effort`
    system message (thinking on only), then the messages, then a `tool-choice` system message
    (tool_choice required), then the generation prompt. [enc]
  - Tools are declared as "# Tools\\nHere are the available tools, described in JSONSchema.\\n\\n```json\\n"
    + the tools list exactly as given (OpenAI shape), keys deep-sorted, compact JSON, non-ASCII
    kept + "\\n```". A system message carrying `tools` declares them mid-conversation ("## New
    Tools Available ..."). [enc]
  - Effort: the message text is the official one (it names `medium`, which the encoder rejects);
    the encoder accepts low / high / max, and the chat template defaults to max, so with thinking
    on an effort message is always rendered; with thinking off none is. [enc; the default is
    `tokenization_kimi.py`'s `kwargs.setdefault("thinking_effort", "max")`, quoted by several ports]
  - OpenAI's reasoning_effort maps as [asc] does: minimal, low -> low; medium, high -> high;
    xhigh, max -> max; none turns thinking off (no think channel, no effort message).
  - Messages: user / system (developer becomes system [asc]) carry `name="…"` when given; so does
    assistant ([enc]; an older derived copy omits it: we follow [enc]). Content is a string or
    text parts, concatenated; images are not supported here.
  - Assistant: with thinking on, `<|open|>think<|sep|>REASONING<|close|>think<|sep|>` on EVERY
    assistant message (the channel is structural: empty when there is no reasoning or it is only
    whitespace; `reasoning_content`, else `reasoning`); with thinking off the channel is dropped
    from every message. Then `<|open|>response<|sep|>CONTENT<|close|>response<|sep|>`, then, with
    calls, `<|open|>tools<|sep|>` + `<|open|>call tool="NAME" index="N"<|sep|>…<|close|>call<|sep|>`
    (N counts from 1) + `<|close|>tools<|sep|>`. [enc]
  - Call arguments (an OpenAI JSON string or a dict) become one typed child per key, in the
    given order: `<|open|>argument key="K" type="T"<|sep|>V<|close|>argument<|sep|>`, T one of
    string / number / boolean / null / object / array, V the string itself or Python's
    `json.dumps(v, ensure_ascii=False)` (default separators). Arguments that are not valid JSON
    are kept verbatim in `<|open|>json type="object"<|sep|>…<|close|>json<|sep|>`; valid JSON that
    is not an object is an error. [enc] The parser reads both forms [asc].
  - Tool results: `<|open|>message role="tool" tool="NAME" index="I"<|sep|>…`, I counting the tool
    messages since the last assistant message from 1; a run of results whose ids all match the
    calls is put in call order; the name comes from the matched call, else from `name`, else by
    position. [enc] We raise ValueError for a `tool_call_id` that matches no call of the last
    assistant message (the encoder falls back to position; a wrong id is a client bug).
  - Only attribute values are escaped (`&` -> `&amp;`, then `"` -> `&quot;`); text never is. [enc]
  - Generation prompt: `<|open|>message role="assistant"<|sep|><|open|>think<|sep|>`, or
    `…<|open|>response<|sep|>` with thinking off. [enc] A reply ends with
    `<|close|>message<|sep|><|end_of_msg|>` (end_of_msg is the checkpoint's eos [ports]) or at eos.
  - tool_choice: "auto"/None as is; "none" offers no tools at all (the encoder would declare them
    and add a "MUST NOT call" message: our choice); "required" adds the
    official tool-choice message and, in the generation prompt, forces a call: the prompt goes on
    past an empty think channel (skipping thinking) and an empty response channel and ends
    opening the tools element, `…<|open|>tools<|sep|>`; a named tool choice does the same and
    also opens `<|open|>call tool="NAME" index="1"<|sep|>` (all tools stay declared, so the
    declaration prefix is the same whatever the choice). `Rendered.opened` says what the prompt
    left open; `XTML.parser_for(rendered)` parses a reply from there.

Loss mask: True exactly on what the model must emit after the generation prompt, for each
assistant message: from the first token after `<|open|>think<|sep|>` (thinking on) or
`<|open|>response<|sep|>` (off) through `<|close|>message<|sep|><|end_of_msg|>`. The official
history rule renders every assistant message the same way (reasoning kept everywhere with
thinking on, dropped everywhere with it off), so every assistant message in the history is
exactly what the model emitted at that turn and all of them carry loss, reasoning included; with
thinking off no reasoning is trained. `render(msgs[:i])` with the generation prompt is a token
prefix of `render(msgs[:i+1])` at every assistant message i (not with tool_choice "required": its
tool-choice message follows the last message; nor for an assistant message with a `name`).


The parser of replies is k3/text/xtml_parser.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from tokenizers import Tokenizer, decoders

from k3.text.tokenizer import CHAT_MARKERS, SPECIAL_TOKENS, encode_texts, prepare, special_ids
from k3.text.xtml_markup import escape_attr, json_compact
from k3.text.xtml_parser import Reply, ReplyParser

RELEASE_EOS = "[EOS]"  # the eos of Kimi's released tokenizers (tokenizer_config.json's eos_token)

EFFORTS = ("low", "high", "max")
DEFAULT_EFFORT = "max"  # the official chat template's default
# OpenAI's reasoning_effort onto K3's levels; None: "none" turns thinking off.
REASONING_EFFORT: dict[str, str | None] = {"none": None, "minimal": "low", "low": "low", "medium": "high",
                                            "high": "high", "xhigh": "max", "max": "max"}
ROLES = ("system", "developer", "user", "assistant", "tool")

EFFORT_TEXT = ("`thinking_effort` guides on how much to think in your thinking channel (not including the "
               "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
               "Now the system is invoked with `thinking_effort={}`.")
TOOLS_TEXT = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{}\n```"
NEW_TOOLS_TEXT = ("## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
                  "You have access to all existing and extended tools.\n"
                  "Here are the specs for the extended tools.\n\n```json\n{}\n```")
TOOL_CHOICE_REQUIRED_TEXT = "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message."


def map_reasoning_effort(value: str | None) -> str | None:
    """OpenAI's reasoning_effort -> K3's level. None for None (the default, max, applies) and for
    "none" (which means thinking off: `render` turns it off)."""
    if value is None:
        return None
    if value not in REASONING_EFFORT:
        raise ValueError(f"reasoning_effort must be one of {list(REASONING_EFFORT)}, got {value!r}")
    return REASONING_EFFORT[value]


def _deep_sort(value):
    if isinstance(value, dict):
        return {k: _deep_sort(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_deep_sort(v) for v in value]
    return value


def _xtml_type(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


IMAGE_PARTS = ("image_url", "image")
# the official encoder's stand-in for an image when it is given no image prompts (`render_text`)
IMAGE_PLACEHOLDER_TEXT = "<|kimi_image_placeholder|>"


def _content_items(content, where: str, images: bool) -> list[str | None]:
    """A message's content as text runs and images (None, in order): a string, None, or a list
    of text parts and, where `images`, image parts (the official encoder puts each image's prompt
    where its part stands). Every bad message raises ValueError (the server answers 400 to one
    exception type)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise ValueError(f"{where}: content must be a string, null or a list of content parts")  # noqa: TRY004
    items: list[str | None] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if isinstance(part, dict) and kind == "text" and isinstance(part.get("text"), str):
            items.append(part["text"])
        elif images and kind in IMAGE_PARTS:
            items.append(None)
        elif kind in IMAGE_PARTS or kind == "video_url":
            raise ValueError(f"{where}: {kind.split('_')[0]} content parts need a model with a vision tower"
                             if not images else f"{where}: a video part must be expanded into its clips first")
        else:
            raise ValueError(f"{where}: unsupported content part {kind!r} (text{' or image_url' if images else ''})")
    return items


def _content_text(content, where: str) -> str:
    """A message's content as one string: text parts only (assistant replies, tool arguments)."""
    return "".join(_content_items(content, where, images=False))


def _call_arguments(arguments, where: str) -> tuple[dict, str | None]:
    """(typed arguments, None) or ({}, raw text) for arguments that are not valid JSON."""
    if arguments is None:
        return {}, None
    if isinstance(arguments, dict):
        return arguments, None
    if not isinstance(arguments, str):
        raise ValueError(f"{where}: arguments must be a JSON object string or a dict")  # noqa: TRY004
    if not arguments.strip():
        return {}, None
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return {}, arguments
    if not isinstance(parsed, dict):
        raise ValueError(f"{where}: arguments must be a JSON object, got {type(parsed).__name__}")  # noqa: TRY004
    return parsed, None


def _call_function(call, where: str) -> dict:
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"{where}: a tool call needs a function name")
    return fn


def _tool_name(tool) -> str | None:
    fn = tool.get("function", tool) if isinstance(tool, dict) else None
    return fn.get("name") if isinstance(fn, dict) else None


def _normalize(messages: list[dict]) -> list[dict]:
    """Roles checked, developer -> system, and each run of tool results resolved against the last
    assistant message's calls: by id (an unknown id raises), put in call order when all match."""
    out: list[dict] = []
    calls: list = []  # the last assistant message's tool calls
    i = 0
    while i < len(messages):
        m = messages[i]
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else None
            raise ValueError(f"messages[{i}]: role must be one of {list(ROLES)}, got {role!r}")
        if m["role"] != "tool":
            if m["role"] == "assistant":
                calls = m.get("tool_calls") or []
            out.append({**m, "role": "system"} if m["role"] == "developer" else m)
            i += 1
            continue
        by_id: dict[str, tuple[int, str]] = {}
        for pos, call in enumerate(calls):
            if isinstance(call, dict) and call.get("id") is not None:
                by_id.setdefault(str(call["id"]), (pos, _call_function(call, f"messages[{i}]")["name"]))
        run = []
        while i < len(messages) and isinstance(messages[i], dict) and messages[i].get("role") == "tool":
            t = messages[i]
            call_id = t.get("tool_call_id")
            if call_id is None:
                run.append((None, t))
            elif str(call_id) not in by_id:
                raise ValueError(f"messages[{i}]: tool_call_id {call_id!r} matches no call of the preceding "
                                 f"assistant message")
            else:
                pos, name = by_id[str(call_id)]
                run.append((pos, {**t, "tool": name}))
            i += 1
        if all(pos is not None for pos, _ in run):
            run.sort(key=lambda item: item[0])  # stable: results of one call keep their order
        out.extend(t for _, t in run)
    return out


MEDIA = "media"  # a part standing for one image's placeholder run


class _Builder:
    """The rendered conversation as parts: (marker name, "", train), (None, text, train) or
    (MEDIA, "", train) for an image."""

    def __init__(self):
        self.parts: list[tuple[str | None, str, bool]] = []
        self.starts: list[int] = []  # part index where each message starts
        self.train = False

    def marker(self, name: str) -> None:
        self.parts.append((name, "", self.train))

    def text(self, text: str) -> None:
        if text:
            self.parts.append((None, text, self.train))

    def body(self, items: list[str | None]) -> None:
        """Content: text runs, and images (None) as media parts, each filled in by `render`."""
        for item in items:
            if item is None:
                self.parts.append((MEDIA, "", self.train))
            else:
                self.text(item)

    def open(self, tag: str, attrs=()) -> None:
        self.marker("open")
        self.text(tag + "".join(f' {k}="{escape_attr(v)}"' for k, v in attrs))
        self.marker("sep")

    def close(self, tag: str) -> None:
        self.marker("close")
        self.text(tag)
        self.marker("sep")

    def message(self, attrs, body: str | list[str | None]) -> None:
        self.starts.append(len(self.parts))
        self.open("message", attrs)
        self.body([body] if isinstance(body, str) else body)
        self.end_message()

    def end_message(self) -> None:
        self.close("message")
        self.marker("end_of_msg")


@dataclass
class Rendered:
    token_ids: list[int]
    boundaries: tuple[int, ...]  # token index where each message starts (>0 only), for prefix-cache checkpoints
    loss_mask: list[bool]  # same length as token_ids: True exactly on tokens an assistant must emit
    opened: str | None = None  # what the generation prompt left open: think / response / tools / call
    forced_tool: str | None = None  # the tool of the call element the prompt opened (named tool_choice)
    tools_offered: bool = False  # tools were declared (tool_choice "none" declares none)
    media_offsets: tuple[int, ...] = ()  # token index of each image's placeholder run, in order


def _byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet: GPT-2's printable stand-in character for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = dict(zip(keep, keep))
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


def _token_bytes(tokenizer: Tokenizer) -> list[bytes]:
    """The bytes each id stands for (none for special tokens), so text is decoded incrementally and
    a character split across tokens is held back rather than broken."""
    specials = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    table = _byte_decoder() if isinstance(tokenizer.decoder, decoders.ByteLevel) else None
    out = []
    for i in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        token = tokenizer.id_to_token(i)
        if token is None or i in specials:
            out.append(b"")
        elif table is not None and all(c in table for c in token):
            out.append(bytes(table[c] for c in token))
        else:  # not byte-level: whole tokens only
            out.append(tokenizer.decode([i], skip_special_tokens=False).encode())
    return out


class XTML:
    """K3's chat format over a tokenizer that has the four markers (every tokenizer k3 trains)."""

    def __init__(self, tokenizer: Tokenizer):
        ids = special_ids(tokenizer, CHAT_MARKERS)  # ValueError naming the missing markers
        # k3's tokenizers call eos <|eos|>; the K3 release's tiktoken.model folder calls it [EOS]
        eos = next((i for i in map(tokenizer.token_to_id, (SPECIAL_TOKENS["eos"], RELEASE_EOS)) if i is not None), None)
        if eos is None:
            raise ValueError(f"tokenizer lacks an eos token ({SPECIAL_TOKENS['eos']} or {RELEASE_EOS})")
        prepare(tokenizer)  # literal marker text in messages encodes as text
        self.tokenizer = tokenizer
        self.marker_ids = {name: ids[name] for name in CHAT_MARKERS}
        self.open, self.sep, self.close = ids["open"], ids["sep"], ids["close"]
        self.end_of_msg, self.eos = ids["end_of_msg"], eos
        self.stop_ids = (self.end_of_msg, self.eos)  # a reply stops at either
        self.token_bytes = _token_bytes(tokenizer)

    # ---- rendering

    def _build(self, messages, tools, reasoning_effort, thinking, add_generation_prompt, tool_choice, images=False):
        if reasoning_effort == "none":
            thinking, effort = False, None
        else:
            effort = map_reasoning_effort(reasoning_effort) or DEFAULT_EFFORT
        tools = list(tools or [])
        forced = None
        if tool_choice in (None, "auto", "none", "required"):
            choice = tool_choice or "auto"
        elif (isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
              and isinstance(tool_choice.get("function"), dict) and isinstance(tool_choice["function"].get("name"), str)):
            choice, forced = "required", tool_choice["function"]["name"]
            if forced not in {_tool_name(t) for t in tools}:
                raise ValueError(f"tool_choice names {forced!r}, which is not among the tools")
        else:
            raise ValueError(f'tool_choice must be "auto", "none", "required" or {{"type": "function", '
                             f'"function": {{"name": ...}}}}, got {tool_choice!r}')
        if choice == "required" and not tools:
            raise ValueError("tool_choice requires tools")
        if choice == "none":
            tools = []
        b = _Builder()
        if tools:
            b.message([("role", "system"), ("type", "tool-declare")], TOOLS_TEXT.format(json_compact(_deep_sort(tools))))
        if thinking:
            b.message([("role", "system"), ("type", "thinking-effort")], EFFORT_TEXT.format(effort))
        calls: list = []
        tool_index = 0
        for i, m in enumerate(_normalize(list(messages))):
            where, role = f"messages[{i}]", m["role"]
            if role == "system" and m.get("tools"):
                b.message([("role", "system"), ("type", "tool-declare")],
                          NEW_TOOLS_TEXT.format(json_compact(_deep_sort(m["tools"]))))
            elif role in ("system", "user"):
                attrs = [("role", role)] + ([("name", m["name"])] if m.get("name") else [])
                b.message(attrs, _content_items(m.get("content"), where, images))
            elif role == "tool":
                tool_index += 1
                name = m.get("tool") or m.get("name")
                if not name and tool_index <= len(calls):
                    name = _call_function(calls[tool_index - 1], where)["name"]
                if not name:
                    raise ValueError(f"{where}: a tool result needs a tool_call_id that matches a call")
                b.message([("role", "tool"), ("tool", name), ("index", tool_index)],
                          _content_items(m.get("content"), where, images))
            else:
                calls, tool_index = m.get("tool_calls") or [], 0
                self._assistant(b, m, thinking, where)
        if choice == "required":
            b.message([("role", "system"), ("type", "tool-choice")], TOOL_CHOICE_REQUIRED_TEXT)
        opened = None
        if add_generation_prompt:
            b.starts.append(len(b.parts))
            b.open("message", [("role", "assistant")])
            if choice == "required":  # a call is the only way on: the think channel is skipped (left empty)
                if thinking:
                    b.open("think")
                    b.close("think")
                b.open("response")
                b.close("response")
                b.open("tools")
                opened = "tools"
                if forced is not None:
                    b.open("call", [("tool", forced), ("index", 1)])
                    opened = "call"
            else:
                opened = "think" if thinking else "response"
                b.open(opened)
        return b, opened, forced if opened == "call" else None, bool(tools)

    def _assistant(self, b: _Builder, m: dict, thinking: bool, where: str) -> None:
        b.starts.append(len(b.parts))
        b.open("message", [("role", "assistant")] + ([("name", m["name"])] if m.get("name") else []))
        if thinking:  # the structural think channel; loss starts after the part a generation prompt supplies
            b.open("think")
            b.train = True
            reasoning = m.get("reasoning_content") or m.get("reasoning")
            if reasoning is not None and str(reasoning).strip():
                b.text(str(reasoning))
            b.close("think")
            b.open("response")
        else:
            b.open("response")
            b.train = True
        b.text(_content_text(m.get("content"), where))
        b.close("response")
        calls = m.get("tool_calls") or []
        if calls:
            b.open("tools")
            for n, call in enumerate(calls, start=1):
                fn = _call_function(call, f"{where}.tool_calls[{n - 1}]")
                args, raw = _call_arguments(fn.get("arguments"), f"{where}.tool_calls[{n - 1}]")
                b.open("call", [("tool", fn["name"]), ("index", n)])
                if raw is not None:
                    b.open("json", [("type", "object")])
                    b.text(raw)
                    b.close("json")
                for key, value in args.items():
                    b.open("argument", [("key", key), ("type", _xtml_type(value))])
                    b.text(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
                    b.close("argument")
                b.close("call")
            b.close("tools")
        b.end_message()
        b.train = False

    def render(self, messages: list[dict], *, tools: list[dict] | None = None, reasoning_effort: str | None = None,
               thinking: bool = True, add_generation_prompt: bool = True, tool_choice=None,
               media: list[list[int]] | None = None) -> Rendered:
        """`media`: the token ids of each image's prompt, in the order the image parts appear (the
        official encoder's `image_prompts`; for k3, each image's run of placeholder ids); None: the
        model takes no images and an image part is an error."""
        b, opened, forced, offered = self._build(messages, tools, reasoning_effort, thinking, add_generation_prompt,
                                                 tool_choice, images=media is not None)
        images = [p for p in b.parts if p[0] == MEDIA]
        if media is not None and len(images) != len(media):
            raise ValueError(f"the messages have {len(images)} image parts, {len(media)} images were given")
        runs: list[str] = []  # each text run between two markers, encoded in one batch
        # (marker id, run index or image index, kind, train); kind: "marker" | "text" | MEDIA
        layout: list[tuple[int, str, bool]] = []
        layout_of: list[int] = []  # each part's layout item
        for name, text, train in b.parts:
            if name == MEDIA:
                layout.append((len([x for x in layout if x[1] == MEDIA]), MEDIA, train))
            elif name is not None:
                layout.append((self.marker_ids[name], "marker", train))
            elif layout and layout[-1][1] == "text":
                if layout[-1][2] != train:
                    raise AssertionError("the loss mask changes inside a text run")
                runs[layout[-1][0]] += text
            else:
                layout.append((len(runs), "text", train))
                runs.append(text)
            layout_of.append(len(layout) - 1)
        encoded = encode_texts(self.tokenizer, runs)
        ids: list[int] = []
        mask: list[bool] = []
        offset: list[int] = []  # token index of each layout item
        media_offsets: list[int] = []
        for value, kind, train in layout:
            offset.append(len(ids))
            if kind == MEDIA:
                media_offsets.append(len(ids))
            new = [value] if kind == "marker" else encoded[value] if kind == "text" else list(media[value])
            ids += new
            mask += [train] * len(new)
        boundaries = tuple(offset[layout_of[s]] for s in b.starts if offset[layout_of[s]] > 0)
        return Rendered(ids, boundaries, mask, opened, forced, offered, tuple(media_offsets))

    def render_text(self, messages: list[dict], *, tools: list[dict] | None = None,
                    reasoning_effort: str | None = None, thinking: bool = True, add_generation_prompt: bool = True,
                    tool_choice=None, images: bool = False) -> str:
        """The string form of `render` (markers as their literal text), for golden tests and logs;
        with `images`, each image part as the official encoder's placeholder text."""
        b, *_ = self._build(messages, tools, reasoning_effort, thinking, add_generation_prompt, tool_choice,
                            images=images)
        return "".join(IMAGE_PLACEHOLDER_TEXT if name == MEDIA else SPECIAL_TOKENS[name] if name is not None
                       else text for name, text, _ in b.parts)

    # ---- parsing

    def parser(self, *, thinking: bool = True, tools: bool = True, opened: str | None = None,
               forced_tool: str | None = None) -> ReplyParser:
        """A parser for the reply to `render(add_generation_prompt=True)`. `opened` is what that
        prompt left open (`Rendered.opened`; default: think with thinking on, else response);
        "call" needs the `forced_tool`. tools=False: the request offered none, so every call is
        reported as an error."""
        return ReplyParser(self, opened=opened or ("think" if thinking else "response"), tools=tools,
                           forced_tool=forced_tool)

    def parser_for(self, rendered: Rendered) -> ReplyParser:
        """The parser for the reply to this rendered prompt."""
        if rendered.opened is None:
            raise ValueError("the prompt was rendered without a generation prompt")
        return self.parser(tools=rendered.tools_offered, opened=rendered.opened, forced_tool=rendered.forced_tool)

    def parse_reply(self, rendered: Rendered, ids) -> Reply:
        """A whole generated reply to this rendered prompt, parsed (the stream parser, fed at once)."""
        parser = self.parser_for(rendered)
        parser.feed(list(ids))
        parser.finish()
        return parser.reply
