"""`k3 chat`: talk to a model in the terminal through the local engine (no HTTP).

A model that was not chat-tuned (a `k3 train` run is pretraining) does not answer, it continues
the conversation's text: `k3 chat` says so once at the start rather than let the replies puzzle.
With a vision model, `/image PATH` attaches a PNG or JPEG to the next message, before its text:
the request a client sends with an `image_url` part and then a `text` part (what a
`k3 train --config k3-tiny-vl` run learns, docs/VISION.md). `/video PATH` attaches a video (MP4
and the like with the `video` extra; animated GIF, WebP, PNG) as the server takes a `video_url`
part: frames sampled at the processor's rate, each 4-frame clip after its start time.
"""
from __future__ import annotations

import argparse
import os
import sys

from k3.serve.cli import LOAD_ERRORS, add_engine_arguments, build_engine, check_engine_settings, usage_error

NOT_CHAT_TUNED = ("note: {name} has not been chat-tuned (its tokenizer_config.json has no chat_template):\n"
                  "      its replies are plain continuations of the conversation's text, not answers.\n"
                  "      A chat model comes from supervised fine-tuning on conversations: k3 sft --run RUN_DIR")
DEFAULT_TEMPERATURE = 0.7
IMAGE_COMMAND = "/image"
VIDEO_COMMAND = "/video"
# what the user reads after a reply, by finish reason (the engine's own names are jargon)
STOPPED = {"stop": "stopped: end of reply", "length": "stopped: length limit ({limit} tokens)",
           "error": "stopped: the model failed ({error})"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=None,
                   help=f"default: the checkpoint's generation_config.json, else {DEFAULT_TEMPERATURE}")
    p.add_argument("--reasoning-effort", default=None, help="low | high | max (default max; OpenAI's names are mapped)")
    p.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=None,
                   help="reply with the think channel (default: on, or as the --run was trained)")
    p.add_argument("--verbose", action="store_true", help="after each reply, also show prompt tokens and "
                                                          "how many came from the prefix cache")


def status_line(request, limit: int, verbose: bool) -> str:
    line = STOPPED.get(request.finish_reason, "stopped: {reason}").format(
        limit=limit, error=request.error, reason=request.finish_reason)
    if verbose:
        line += (f" [{request.num_prompt_tokens} prompt tokens, {request.num_cached_tokens or 0} from the prefix "
                 f"cache; {len(request.output_token_ids)} generated]")
    return line


def styled_output() -> bool:
    """Dim reasoning with ANSI codes only on a terminal, and not under NO_COLOR (no-color.org)."""
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


class ReplyPrinter:
    """Prints a reply as it arrives: on a terminal the reasoning dimmed, else (piped, NO_COLOR) the
    reasoning under a "thinking:" label and the answer on a line of its own, with no escape codes."""

    def __init__(self, styled: bool):
        self.styled, self.last = styled, None

    def __call__(self, events) -> None:
        for kind, text, *_ in events:
            if kind not in ("reasoning", "content"):
                continue
            if self.styled:
                print(f"\033[2m{text}\033[0m" if kind == "reasoning" else text, end="", flush=True)
                continue
            if kind != self.last:
                print(("\n" if self.last else "") + ("thinking: " if kind == "reasoning" else ""), end="")
            print(text, end="", flush=True)
            self.last = kind


def run(args) -> int:
    from k3.media.image_processor import ImageProcessor
    from k3.serve.api.images import ImageError, PreparedImages, image_part_from_file, prepare_image
    from k3.serve.api.videos import clip_parts, prepare_video, video_part_from_file
    from k3.serve.loading import load_for_serving, run_chat_defaults
    from k3.serve.request import ContextLengthError, fit_model_length
    from k3.serve.sampling import SamplingParams
    from k3.text.xtml import XTML, map_reasoning_effort

    try:
        check_engine_settings(args)
        served = load_for_serving(args.run, args.model, args.tokenizer, args.device, args.dtype)
        model, name, chat_tuned, chat = served.model, served.name, served.chat_tuned, served.chat
        if chat is None:  # no K3 chat markers and no chat template: no conversation to hold
            XTML(served.tokenizer)  # raises, naming the markers it lacks
        temperature = args.temperature if args.temperature is not None else (
            served.generation.temperature if served.generation.temperature is not None else DEFAULT_TEMPERATURE)
        SamplingParams(max_tokens=args.max_tokens, temperature=temperature)  # bad values: one line
        map_reasoning_effort(args.reasoning_effort)
        engine = build_engine(model, args)
    except LOAD_ERRORS as e:
        return usage_error("chat", e)
    thinking = args.thinking if args.thinking is not None else run_chat_defaults(args.run).get("thinking", True)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    vision = engine.vision
    processor = None if vision is None else ImageProcessor.from_vision_config(vision.config.vision_config)
    # content parts for the next user message, processed: an image's part, or a video's clips
    attached: list[tuple[list[dict], PreparedImages]] = []
    history = PreparedImages([], [], [], [])  # the conversation's images and clips so far, processed once each
    styled = styled_output()
    print(f"k3 chat with {name}: empty line or Ctrl-D to quit"
          + ("; /image PATH or /video PATH attaches one to your next message" if processor else ""))
    if not chat_tuned:
        print(NOT_CHAT_TUNED.format(name=name))
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        command = line.split(maxsplit=1)[0]
        if command in (IMAGE_COMMAND, VIDEO_COMMAND):
            if processor is None:
                print(f"[{name} has no vision tower: {command} needs a multimodal checkpoint]")
                continue
            path = line[len(command):].strip()
            try:
                if command == IMAGE_COMMAND:
                    part = image_part_from_file(path)
                    attached.append(([part], prepare_image(part["image_url"]["url"], path, processor)))
                else:
                    clips, stamps = prepare_video(video_part_from_file(path)["video_url"]["url"], path, processor,
                                                  max_placeholders=engine.max_model_len)
                    attached.append((clip_parts(stamps), clips))
            except ImageError as e:
                print(f"[{e}]")
                continue
            print(f"[attached {path}: it goes with your next message]")
            continue
        content = [*(p for parts, _ in attached for p in parts), {"type": "text", "text": line}] if attached else line
        messages.append({"role": "user", "content": content})
        known = len(history.counts)
        for _, prepared in attached:
            history.extend(prepared)
        attached = []
        # every image and clip of the history, in order: earlier ones hit the prefix cache
        media = None if processor is None else history.media(engine.media_placeholder_token_id)
        try:
            prompt = chat.render(messages, reasoning_effort=args.reasoning_effort, thinking=thinking, media=media)
        except ValueError as e:  # e.g. a folder's chat template that fails on this conversation
            messages.pop()
            history.truncate(known)
            print(f"[not sent: {e}]")
            continue
        images = [] if processor is None else history.engine_inputs(prompt.media_offsets)
        try:  # the reply may take what the model length leaves, up to --max-tokens
            budget = min(args.max_tokens, fit_model_length(len(prompt.token_ids), None, engine.max_model_len))
        except ContextLengthError:  # drop this message (and its media), keep the conversation
            messages.pop()
            history.truncate(known)
            print(f"[not sent: with this message the conversation is {len(prompt.token_ids)} tokens, the model "
                  f"takes {engine.max_model_len}; send a shorter one, with fewer or smaller pictures]")
            continue
        request = engine.add_request(prompt.token_ids, SamplingParams(
            max_tokens=budget, temperature=temperature, top_p=served.generation.top_p or 1.0,
            stop_token_ids=[chat.eos, *served.generation.eos_token_ids]),
                                     boundaries=prompt.boundaries, eos_token_id=chat.end_of_msg, images=images)
        parser, shown, show = chat.parser_for(prompt), 0, ReplyPrinter(styled)
        while not request.status.finished:
            engine.step()
            new = request.output_token_ids[shown:]
            shown = len(request.output_token_ids)
            show(parser.feed(new))
        show(parser.finish())
        print(f"\n[{status_line(request, budget, args.verbose)}]")
        reply = {"role": "assistant", "content": parser.reply.content}
        if parser.reply.reasoning:
            reply["reasoning_content"] = parser.reply.reasoning  # kept in history while thinking is on
        messages.append(reply)
    return 0
