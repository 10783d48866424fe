import pytest

from k3.cli import main


def test_unknown_verb_names_itself(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["trian"])
    assert exit_.value.code == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


def test_no_verb_prints_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        main([])
    assert exit_.value.code == 0 and "params" in capsys.readouterr().out


def test_every_verb_lists_threads_in_its_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["params", "--help"])
    assert exit_.value.code == 0 and "--threads N" in capsys.readouterr().out


def test_threads_without_a_value_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["params", "--threads"])
    assert exit_.value.code == 2 and "--threads expects a number" in capsys.readouterr().err
