"""The cold-start SFT data: valid conversations, never a held-out prompt, bad input refused."""
from __future__ import annotations

from k3.rl.cold_start import conversations, main
from k3.tasks.conversations import read_conversations
from k3.tasks.domains import make_domain


def test_cold_start_is_valid_sft_data_and_never_held_out(tmp_path):
    path = tmp_path / "cold.jsonl"
    assert main([str(path), "--size", "20", "--default-set", "10"]) == 0
    convs = read_conversations(path)  # the SFT reader accepts every line
    assert len(convs) == 3 * 20 + 10
    users = {c.messages[0]["content"] for c in convs}
    for name in ("arithmetic", "strings"):
        held = {t.messages[0]["content"] for t in make_domain(name).heldout(64)}
        assert not users & held
    assert conversations(["strings"], 3) == conversations(["strings"], 3)  # deterministic


def test_unknown_domain_is_exit_2(tmp_path, capsys):
    assert main([str(tmp_path / "x.jsonl"), "--domains", "arithmetic,poetry"]) == 2
    assert "poetry" in capsys.readouterr().err and not (tmp_path / "x.jsonl").exists()


def test_efforts_take_turns_and_low_drops_the_trace(tmp_path):
    convs = conversations(["arithmetic"], 3, efforts=["max", "low"])
    assert [c.get("reasoning_effort") for c in convs] == [None, "low", None]
    assert "reasoning_content" in convs[0]["messages"][-1] and "reasoning_content" not in convs[1]["messages"][-1]
    assert convs[1]["messages"][-1]["content"] == make_domain("arithmetic").tasks("train", 2, start=1_000_000)[1].answer
    assert conversations(["strings"], 4) == conversations(["strings"], 4, efforts=["max", "high", "low"])  # the default
    path = tmp_path / "cold.jsonl"
    assert main([str(path), "--size", "3", "--default-set", "0"]) == 0
    assert {c.reasoning_effort for c in read_conversations(path)} == {None, "high", "low"}
    assert main([str(path), "--size", "3", "--default-set", "0", "--efforts", "max"]) == 0
    assert {c.reasoning_effort for c in read_conversations(path)} == {None}
    assert main([str(tmp_path / "x.jsonl"), "--efforts", "max,lazy"]) == 2


def test_high_thinks_the_brief_trace_and_full_keeps_the_old_data():
    tasks = make_domain("arithmetic").tasks("train", 3, start=1_000_000)
    brief = conversations(["arithmetic"], 3)
    full = conversations(["arithmetic"], 3, high_trace="full")
    assert brief[0] == full[0] and brief[2] == full[2]  # max and low do not depend on it
    assert brief[1]["messages"][-1]["reasoning_content"] == tasks[1].brief
    assert full[1]["messages"][-1]["reasoning_content"] == tasks[1].reference[0]["reasoning_content"]
    assert brief[1]["messages"][-1]["content"] == full[1]["messages"][-1]["content"] == tasks[1].answer
