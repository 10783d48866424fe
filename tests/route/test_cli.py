"""`k3 route` at the command line: bad fleets fail at start in one line, before anything is served;
it starts without loading torch."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from k3.route import cli
from k3.serve.api.server import ServerThread
from tests.route.fakes import Behaviour, fake_replica


def route(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return cli.run(p.parse_args(argv))


@pytest.mark.parametrize("argv,message", [
    (["--replica", "localhost:8000"], "is not a URL like http://127.0.0.1:8000"),
    (["--spawn", "2"], "--spawn needs --run or --model"),
    (["--spawn", "0", "--run", "x"], "--spawn must be >= 1"),
    (["--replica", "http://127.0.0.1:1", "--long-budget", "0"], "admission long must be >= 1"),
    (["--replica", "http://127.0.0.1:1", "--long-prefills", "0"], "admission long prefills must be >= 1"),
    (["--replica", "http://127.0.0.1:1", "--short-replicas", "-1"], "admission short replicas must be >= 0"),
])
def test_bad_options_are_one_line(capsys, argv, message):
    assert route(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("k3 route: error: ") and message in err and "\n" not in err, err


def test_a_url_that_is_not_a_k3_server_is_refused_at_start(capsys):
    with ServerThread(fake_replica(Behaviour(k3=False))) as other:
        assert route(["--replica", other.url, "--port", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == f"k3 route: error: {other.url} is not a k3 server (GET /v1/models: HTTP 404, not a k3 model list)"


def test_k3_route_never_imports_torch():
    code = ("import sys\nfrom k3.cli import main\ntry:\n    main(['route', '--replica', 'http://127.0.0.1:1', "
            "'--run', '/nonexistent-run'])\nexcept SystemExit:\n    pass\n"
            "print('k3.route.app' in sys.modules, 'k3.serve.model_source' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "True", "False"], out.stdout + out.stderr  # the whole start path, no torch
