"""`k3 chat`: talk to a model in the terminal through the local engine (no HTTP)."""
from __future__ import annotations

import argparse

from k3.serve.cli import add_engine_arguments, engine_config, usage_error


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--reasoning-effort", default=None, help="low | high | max (OpenAI's names are mapped)")


def run(args) -> int:
    from k3.serve.detokenizer import IncrementalDetokenizer
    from k3.serve.engine import LLMEngine
    from k3.serve.loading import load_for_serving
    from k3.serve.sampling import SamplingParams
    from k3.text.chat_format import ChatFormat, ReplyParser

    try:
        model, tokenizer, name = load_for_serving(args.run, args.model, args.tokenizer, args.device, args.dtype)
    except (ValueError, OSError) as e:  # a bad --run / --model / --tokenizer: one line, not a traceback
        return usage_error("chat", e)
    engine = LLMEngine(model, engine_config(args))
    chat = ChatFormat(tokenizer)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print(f"k3 chat with {name}: empty line or Ctrl-D to quit")
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        prompt = chat.render(messages, reasoning_effort=args.reasoning_effort)
        budget = min(args.max_tokens, engine.max_model_len - len(prompt.token_ids))
        if budget < 1:
            print("[the conversation fills the model length]")
            break
        request = engine.add_request(prompt.token_ids, SamplingParams(max_tokens=budget, temperature=args.temperature,
                                                                      stop_token_ids=[chat.eos]),
                                     boundaries=prompt.boundaries, eos_token_id=chat.close)
        detok, parser, shown = IncrementalDetokenizer(tokenizer), ReplyParser(tools=False), 0
        while not request.status.finished:
            engine.step()
            new = request.output_token_ids[shown:]
            shown = len(request.output_token_ids)
            events = parser.feed(detok.push(new))
            for kind, text in events:
                print(f"\033[2m{text}\033[0m" if kind == "reasoning" else text, end="", flush=True)
        for kind, text in parser.finish():
            print(text, end="")
        print(f"\n[{request.finish_reason}; {request.num_cached_tokens} of {request.num_prompt_tokens} prompt tokens "
              f"from the prefix cache]")
        messages.append({"role": "assistant", "content": parser.reply.content})
    return 0
