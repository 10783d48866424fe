import pytest

from k3.cli import COMMANDS, main


def test_unknown_verb_names_itself(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["trian"])
    assert exit_.value.code == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


def test_no_verb_prints_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        main([])
    assert exit_.value.code == 0 and "params" in capsys.readouterr().out


@pytest.mark.parametrize("verb", sorted(COMMANDS))
def test_every_verb_has_help_listing_threads(capsys, verb):
    with pytest.raises(SystemExit) as exit_:
        main([verb, "--help"])
    assert exit_.value.code == 0 and "--threads N" in capsys.readouterr().out


def test_threads_without_a_value_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["params", "--threads"])
    assert exit_.value.code == 2 and "--threads expects a number" in capsys.readouterr().err
