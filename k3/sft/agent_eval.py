"""Held-out agent episodes, batched: prompt -> reply (maybe a tool call) -> tool result -> final reply.

Every episode's first reply is generated in one batch, the tools the model called are executed with
the model's own arguments (k3/tasks/tools.py), and the final replies are generated in a second batch;
k3/tasks/scoring.py then scores each episode (valid XTML, right tool, valid arguments, final answer).
Greedy decoding, so the figures are a pure function of the weights.
"""
from __future__ import annotations

import torch

from k3.generation.generate import generate
from k3.tasks.scoring import score, summarize
from k3.tasks.tools import call_tool
from k3.text.xtml import XTML


def prompt_messages(messages: list[dict]) -> list[dict]:
    """The messages before the first assistant message: what the model is asked."""
    for i, m in enumerate(messages):
        if m.get("role") == "assistant":
            return messages[:i]
    return list(messages)


@torch.no_grad()
def replies(model, chat: XTML, conversations: list[tuple[list[dict], list[dict] | None]], max_tokens: int):
    """Greedy replies (parsed) to each (messages, tools), in one batch."""
    if not conversations:
        return [], []
    rendered = [chat.render(m, tools=t) for m, t in conversations]
    outs = generate(model, [r.token_ids for r in rendered], max_tokens, eos_token_id=chat.stop_ids)
    return [chat.parse_reply(r, ids) for r, ids in zip(rendered, outs)], outs


def assistant_message(reply) -> dict:
    message = {"role": "assistant", "content": reply.content or None}
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        message["tool_calls"] = reply.tool_calls
    return message


@torch.no_grad()
def run_episodes(model, chat: XTML, conversations, max_tokens: int = 160) -> tuple[dict, list[dict]]:
    """`conversations`: objects with `.messages`, `.tools` and `.expected` (k3/tasks/conversations.py).
    Returns (summary of the scores, one record per episode)."""
    was_training = model.training
    model.eval()
    try:
        asked = [(prompt_messages(c.messages), c.tools) for c in conversations]
        first, first_ids = replies(model, chat, asked, max_tokens)
        follow = [i for i, r in enumerate(first) if r.tool_calls]
        second_inputs = []
        for i in follow:
            messages, tools = asked[i]
            results = [{"role": "tool", "tool_call_id": call["id"],
                        "content": call_tool(call["function"]["name"], call["function"]["arguments"])}
                       for call in first[i].tool_calls]
            second_inputs.append((messages + [assistant_message(first[i])] + results, tools))
        second, second_ids = replies(model, chat, second_inputs, max_tokens)
        final = dict(zip(follow, second))
        final_ids = dict(zip(follow, second_ids))
    finally:
        model.train(was_training)
    scores, records = [], []
    for i, conv in enumerate(conversations):
        s = score(conv.expected, first[i], final.get(i))
        scores.append(s)
        records.append({"line": conv.line, **s, "reply": chat.tokenizer.decode(first_ids[i], skip_special_tokens=False),
                        "final": chat.tokenizer.decode(final_ids[i], skip_special_tokens=False) if i in final else None})
    summary = summarize(scores)
    # the agent-loop bars read over the prompts that need a tool: right tool with valid arguments, answer after it
    tool = [sc for sc, conv in zip(scores, conversations) if conv.expected.get("tool") is not None]
    if tool:
        summary["tool_prompts_tool_ok"] = sum(sc["tool_ok"] for sc in tool) / len(tool)
        summary["tool_prompts_answer_correct"] = sum(sc["answer_correct"] for sc in tool) / len(tool)
    return summary, records
