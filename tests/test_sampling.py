"""k3/sampling.py is token sampling's one home: the primitives and the bounds live there only, and
every place that checks a temperature, top_p or top_k checks it with `check_sampling` (the serving
parameters, `k3 generate`) or declares the same bounds (the API schema)."""
from __future__ import annotations

import argparse
import ast
import math
from pathlib import Path

import pytest
from pydantic import ValidationError

from k3.generation import cli as generate_cli
from k3.sampling import MAX_TEMPERATURE, check_sampling
from k3.serve.api.protocol import CompletionRequest
from k3.serve.sampling import SamplingParams

K3 = Path(__file__).resolve().parent.parent / "k3"
HOME = K3 / "sampling.py"
SHARED = {"GREEDY_BELOW", "MAX_TEMPERATURE", "check_sampling", "sample_next", "sampling_probs"}

GOOD = [{"temperature": 0.0}, {"temperature": MAX_TEMPERATURE}, {"temperature": 1e-40}, {"top_p": 1.0},
        {"top_p": 5e-324}, {"top_k": 0}, {"top_k": 10**9}]
BAD = [({"temperature": -0.1}, "temperature"), ({"temperature": MAX_TEMPERATURE + 1e-9}, "temperature"),
       ({"temperature": math.nan}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.01}, "top_p"),
       ({"top_p": math.nan}, "top_p"), ({"top_k": -1}, "top_k")]


@pytest.mark.parametrize("kw", GOOD)
def test_check_sampling_accepts_the_range(kw):
    check_sampling(**kw)
    SamplingParams(**kw)


@pytest.mark.parametrize(("kw", "name"), BAD)
def test_check_sampling_names_the_bad_parameter_and_serving_says_the_same(kw, name):
    with pytest.raises(ValueError, match=f"^{name} must be") as checked:
        check_sampling(**kw)
    with pytest.raises(ValueError) as served:
        SamplingParams(**kw)
    assert str(served.value) == str(checked.value)


def test_the_api_schema_takes_the_same_temperature_range():
    assert CompletionRequest(model="m", prompt="x", temperature=MAX_TEMPERATURE).temperature == MAX_TEMPERATURE
    with pytest.raises(ValidationError):
        CompletionRequest(model="m", prompt="x", temperature=MAX_TEMPERATURE + 0.01)


@pytest.mark.parametrize("argv", [["--temperature", str(MAX_TEMPERATURE + 0.5)], ["--top-p", "0"],
                                  ["--top-k", "-1"], ["--max-tokens", "0"]])
def test_generate_verb_rejects_what_check_sampling_rejects(argv, capsys):
    p = argparse.ArgumentParser()
    generate_cli.add_arguments(p)
    args = p.parse_args(["--run", "/nonexistent", "--prompt", "hi", *argv])
    assert generate_cli.run(args) == 2
    assert f"--temperature <= {MAX_TEMPERATURE:g}" in capsys.readouterr().err


def _defined_and_imported(path: Path) -> tuple[set[str], dict[str, str]]:
    """Top-level names `path` defines (functions, classes, assignments), and the names it imports
    from k3 modules (name -> module)."""
    tree = ast.parse(path.read_text())
    defined, imported = set(), {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined |= {t.id for t in targets if isinstance(t, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("k3"):
            imported |= {a.name: node.module for a in node.names}
    return defined, imported


def test_primitives_and_bounds_have_one_home():
    for path in sorted(K3.rglob("*.py")):
        defined, imported = _defined_and_imported(path)
        if path == HOME:
            assert SHARED <= defined
            continue
        rel = path.relative_to(K3.parent)
        assert not defined & SHARED, f"{rel} defines {sorted(defined & SHARED)}: they live in k3/sampling.py"
        elsewhere = {n: m for n, m in imported.items() if n in SHARED and m != "k3.sampling"}
        assert not elsewhere, f"{rel} imports {elsewhere}: import them from k3.sampling"
