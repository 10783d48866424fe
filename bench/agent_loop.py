"""The SFT agent loop, played with the unmodified `openai` client against
a running `k3 serve --run <sft run>`: held-out tool prompts of the default SFT set, greedy, each
asked streamed and not; the client runs the tool call the reply makes (k3/tasks/tools.py), sends the
result and reads the final answer. Prints a line per prompt and a summary (docs/BENCHMARKS.md
"Post-training").

    k3 serve --run RUN --port 8811 &
    python -m bench.agent_loop --port 8811 [--prompts 12]
"""
from __future__ import annotations

import argparse

import openai

from k3.tasks import default_set
from k3.tasks.episodes import prompt_messages
from k3.tasks.tools import call_tool


def turn(client, model: str, messages: list[dict], tools: list[dict], stream: bool):
    """(content or None, [(id, name, arguments)], finish_reason) of one greedy reply."""
    kw = {"model": model, "messages": messages, "tools": tools, "temperature": 0, "max_tokens": 160}
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        calls = [(t.id, t.function.name, t.function.arguments) for t in choice.message.tool_calls or []]
        return choice.message.content or None, calls, choice.finish_reason
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for t in choice.delta.tool_calls or []:  # fragments by index: id and name first, then arguments
            call = calls.setdefault(t.index, ["", "", ""])
            call[0] += t.id or ""
            if t.function is not None:
                call[1] += t.function.name or ""
                call[2] += t.function.arguments or ""
        finish = choice.finish_reason or finish
    return content or None, [tuple(c) for _, c in sorted(calls.items())], finish


def episode(client, model: str, conv, stream: bool) -> list:
    """The turns of one prompt: the reply, and after its tool calls' results the final reply."""
    messages = [dict(m) for m in prompt_messages(conv.messages)]
    first = turn(client, model, messages, conv.tools, stream)
    turns = [first]
    if first[1]:
        calls = first[1]
        messages.append({"role": "assistant", "content": first[0], "tool_calls": [
            {"id": i, "type": "function", "function": {"name": name, "arguments": args}} for i, name, args in calls]})
        messages += [{"role": "tool", "tool_call_id": i, "content": call_tool(name, args)} for i, name, args in calls]
        turns.append(turn(client, model, messages, conv.tools, stream))
    return turns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prompts", type=int, default=12, help="held-out prompts that need a tool (default 12)")
    args = ap.parse_args()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="none", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    held = [c for c in default_set.load("heldout", 64, 0) if c.expected["tool"]][:args.prompts]
    same = called = right = 0
    for conv in held:
        plain, streamed = episode(client, model, conv, False), episode(client, model, conv, True)
        final = plain[-1][0] or ""
        same += plain == streamed
        called += plain[0][2] == "tool_calls"
        right += conv.expected["answer"] in final
        question = next(m["content"] for m in conv.messages if m["role"] == "user")
        print(f"{question!r} -> {[c[1:] for c in plain[0][1]]} -> {final!r} (streamed the same: {plain == streamed})")
    print(f"{len(held)} prompts: identical streamed and not {same}, ended in tool_calls {called}, "
          f"final answer right {right}")


if __name__ == "__main__":
    main()
