"""The cold-start SFT data: valid conversations, never a held-out prompt, bad input refused."""
from __future__ import annotations

from k3.rl.cold_start import conversations, main
from k3.rl.domains import make_domain
from k3.sft.dataset import read_conversations


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
