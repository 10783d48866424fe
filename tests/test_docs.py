"""The docs name what exists: every repository path in README.md and docs/ARCHITECTURE.md (in
backticks, prose or the map), every `k3 VERB` README shows, every `python -m bench.X` the docs
give; and no comment or docstring under k3/ cites a run, a date or a raw log file."""
from __future__ import annotations

import ast
import io
import itertools
import re
import tokenize
from pathlib import Path

import pytest

from k3.cli import COMMANDS

ROOT = Path(__file__).resolve().parent.parent
PATH_DOCS = ["README.md", "docs/README.md", "docs/ARCHITECTURE.md", "docs/DESIGN.md", "docs/KDA.md",
             "docs/BENCHMARKS.md"]
BENCH_DOCS = ["README.md", "docs/ARCHITECTURE.md", "docs/BENCHMARKS.md", "docs/LOG.md"]
# Verbs README may name before they exist, each with where it is planned; remove one once it ships.
PLANNED_VERBS: dict[str, str] = {}  # verb -> the issue that will build it

PATH = re.compile(r"(?<![\w./-])((?:k3|tests|bench|docs)/[\w./{},*-]*)")
MAP_ENTRY = re.compile(r"^( {0,12})([\w.{},/-]+)(?:\s|$)")
DESCRIBED_FILE = re.compile(r"(?<![\w/.`])([\w/]+\.py)\b")
CITATION = re.compile(r"\bruns? \d+|\b20\d\d-\d\d\b|gpu_runs/")
# The outside documents the project once cited, and issue references ("#12", "#24's") in prose:
# the repository cites its own docs (docs/DESIGN.md) and public papers or reports only.
OUTSIDE_CITATION = re.compile(r"SPEC §|SPEC\.md|seeds §|(?<![\w&/])#\d{1,3}\b")
SELF_CONTAINED_SUFFIXES = {".py", ".md", ".json", ".jinja", ".toml", ".txt", ".sh"}


def expand_braces(path: str) -> list[str]:
    """`k3/ops/kda/{gate,inputs}.py` -> both paths (one level of braces, any number of groups)."""
    pieces = re.split(r"\{([^{}]*)\}", path)
    options = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(pieces)]
    return ["".join(combo) for combo in itertools.product(*options)]


def code_blocks(text: str) -> list[str]:
    return re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


def map_paths(block: str) -> list[str]:
    """Paths of an indented tree (`k3/` then `  ops/` then `    kda/`): an entry is a line whose first
    token is a file or folder name at an indent of at most 12; deeper lines continue its description.
    File names in a description (`reference.py`, `model/params.py`) are taken relative to the entry's
    folder (a folder entry's own, a file entry's parent)."""
    stack: list[tuple[int, str]] = []
    paths = []
    here = None  # the folder the current description's file names are relative to
    for line in block.splitlines():
        m = MAP_ENTRY.match(line)
        name = m.group(2) if m else ""
        if m and (name.endswith(("/", ".py", ".md", ".toml")) or "{" in name):
            indent = len(m.group(1))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            if not stack and not name.startswith(("k3/", "tests/", "bench/", "docs/")):
                here = None
                continue  # a tree of something else
            parent = stack[-1][1] if stack else ""
            full = parent + name
            paths.append(full)
            if name.endswith("/"):
                stack.append((indent, full))
            here = full if name.endswith("/") else full.rpartition("/")[0] + "/"
            line = line[m.end():]
        if here:
            paths += [here + f for f in DESCRIBED_FILE.findall(line)
                      if not f.startswith(("k3/", "tests/", "bench/", "docs/"))]
    return paths


def named_paths(doc: str) -> list[str]:
    text = (ROOT / doc).read_text()
    found = [m.rstrip(".,;:)") for m in PATH.findall(text)]
    for block in code_blocks(text):
        found += map_paths(block)
    out = []
    for p in found:
        p = p.split("::")[0]
        out += [q for q in expand_braces(p) if "*" not in q and "<" not in q]
    return sorted(set(out))


@pytest.mark.parametrize("doc", PATH_DOCS)
def test_paths_named_in_docs_exist(doc):
    paths = named_paths(doc)
    assert paths, f"{doc}: found no paths at all (the pattern is broken)"
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"{doc} names paths that do not exist: {', '.join(missing)}"


def test_map_parser_reads_nesting():
    block = ("k3/\n  ops/              ops\n    kda/            chunk.py (torch),\n"
             "                      reference.py\n      gate.py       why\n  cli.py            see model/params.py\n")
    assert map_paths(block) == ["k3/", "k3/ops/", "k3/ops/kda/", "k3/ops/kda/chunk.py", "k3/ops/kda/reference.py",
                                "k3/ops/kda/gate.py", "k3/cli.py", "k3/model/params.py"]
    assert expand_braces("k3/ops/kda/{gate,inputs}.py") == ["k3/ops/kda/gate.py", "k3/ops/kda/inputs.py"]


def readme_verbs() -> set[str]:
    """`k3 VERB` inside code spans and code blocks (prose says "k3 picks", which is no verb; Python's
    `from k3 import ...` neither)."""
    text = (ROOT / "README.md").read_text()
    code = code_blocks(text) + re.findall(r"`([^`\n]+)`", text)
    return {v for c in code for v in re.findall(r"(?<![\w/.-])(?<!from )k3 ([a-z][a-z-]*)", c)}


def test_readme_verbs_are_real():
    verbs = readme_verbs()
    assert {"train", "serve"} <= verbs, verbs
    unknown = sorted(v for v in verbs if v not in COMMANDS and v not in PLANNED_VERBS)
    assert not unknown, f"README names verbs k3.cli does not have: {unknown}"
    shipped = sorted(v for v in PLANNED_VERBS if v in COMMANDS)
    assert not shipped, f"planned verbs now exist; drop them from PLANNED_VERBS and update README: {shipped}"


def test_planned_verbs_are_said_to_be_planned():
    text = (ROOT / "README.md").read_text()
    for verb, where in PLANNED_VERBS.items():
        if f"k3 {verb}" in text:
            line = next(l for l in text.splitlines() if f"k3 {verb}" in l)
            assert where in text and "not yet" in text, f"README names `k3 {verb}` without saying it is planned: {line}"


@pytest.mark.parametrize("doc", BENCH_DOCS)
def test_bench_commands_exist(doc):
    text = (ROOT / doc).read_text()
    missing = sorted({m for m in re.findall(r"python3? -m bench\.([a-z][a-z0-9_]*)\b", text) if not (ROOT / "bench" / f"{m}.py").exists()})
    assert not missing, f"{doc} runs bench scripts that do not exist: {', '.join(f'bench/{m}.py' for m in missing)}"


def comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    source = path.read_text()
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
           if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                start = node.body[0].lineno
                out += [(start + i, line) for i, line in enumerate(doc.splitlines())]
    return out


def test_no_comment_cites_a_run_or_date():
    """A comment gives the reason; which run saw it belongs in docs/LOG.md or the commit message."""
    hits = [f"{path.relative_to(ROOT)}:{line}: {text.strip()}"
            for path in sorted((ROOT / "k3").rglob("*.py"))
            for line, text in comments_and_docstrings(path) if CITATION.search(text)]
    assert not hits, "comments citing a run, a date or a log file:\n" + "\n".join(hits)


def test_architecture_map_covers_every_module():
    """The map is the tree: a module added without a line in docs/ARCHITECTURE.md fails here."""
    named = set(named_paths("docs/ARCHITECTURE.md"))
    modules = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "k3").rglob("*.py"))
               if p.name not in ("__init__.py", "__main__.py")]
    missing = [m for m in modules if m not in named]
    assert not missing, f"docs/ARCHITECTURE.md's map does not name: {', '.join(missing)}"


BENCHMARKS_MAX_LINES = 200


def test_benchmarks_holds_current_figures_only():
    """docs/BENCHMARKS.md is a table of current figures: findings go to docs/LOG.md, so it stays short."""
    lines = (ROOT / "docs/BENCHMARKS.md").read_text().count("\n")
    assert lines <= BENCHMARKS_MAX_LINES, f"docs/BENCHMARKS.md has {lines} lines (at most {BENCHMARKS_MAX_LINES})"


def self_contained_files() -> list[Path]:
    """The text files of k3/, bench/ and tests/ (this file aside: it names the patterns), docs/ and
    README.md."""
    files = [p for d in ("k3", "bench", "tests", "docs") for p in sorted((ROOT / d).rglob("*"))
             if p.is_file() and p.suffix in SELF_CONTAINED_SUFFIXES and "__pycache__" not in p.parts]
    return [p for p in files if p != Path(__file__).resolve()] + [ROOT / "README.md"]


def test_no_outside_document_or_issue_is_cited():
    """Code and docs cite docs/DESIGN.md ("DESIGN §N") and public sources, never a file outside the
    repository ("SPEC §N", "seeds §N") or an issue number: a reader of the repository has neither."""
    files = self_contained_files()
    assert any(p.name == "DESIGN.md" for p in files) and any(p.suffix == ".py" for p in files)
    hits = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
            for path in files
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
            if OUTSIDE_CITATION.search(line)]
    assert not hits, "citations of outside documents or issue numbers:\n" + "\n".join(hits)


@pytest.mark.parametrize("text, cited", [("SPEC §3", True), ("(seeds §6.1.2)", True), ("SPEC.md", True),
                                         ("issue #23", True), ("#24's copying", True), ("fla issue #1240", False),
                                         ("DESIGN §3", False), ("SPECIAL_TOKENS", False), ("over 3 seeds", False),
                                         ("color #fff", False), ("[a](#section-2)", False), ("&#39;", False)])
def test_outside_citation_pattern(text, cited):
    assert bool(OUTSIDE_CITATION.search(text)) == cited
