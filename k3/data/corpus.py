"""Documents for training: the bundled Shakespeare corpus or the user's files, split by document.

A document is one unit that never shares context with another (packing puts a boundary between
documents, k3/train/packing.py). Sources:
- nothing (`None`): the bundled corpus, one document per work (k3/data/ATTRIBUTION.md);
- a `.txt` (or any non-JSONL) file: one document per file;
- a `.jsonl` file: one document per line, from its `text` field;
- a folder: every `*.txt` and `*.jsonl` file under it, recursively, in sorted order.
A file or folder that cannot be read (permissions) is a DataError that says so, never "does not
exist" or "empty corpus".
A corpus of a single document (one plain text file) is cut into `SINGLE_DOC_PIECES` pieces at
paragraph breaks, so that a split by document still exists.

The split is deterministic and independent of file order: documents are ranked by the SHA-256 of
their split key (unique per document: the bundled work id, the file path, or "file:line" for JSONL,
whatever the records' own "id" fields say) and the first `ceil(val_fraction * N)` (at least one,
at most N - 1) form the validation set.
"""
from __future__ import annotations

import hashlib
import lzma
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from k3.data.jsonl import jsonl_records

BUNDLED = Path(__file__).parent / "shakespeare.jsonl.xz"
SINGLE_DOC_PIECES = 100


class DataError(ValueError):
    """Unusable training data; the message says what and where."""


@dataclass(frozen=True)
class Document:
    id: str  # stable across runs: bundled work id, relative file path, the record's "id" or "path:line"
    text: str
    key: str | None = None  # unique split key ("path:line" for JSONL records); None: the id

    @property
    def split_key(self) -> str:
        return self.id if self.key is None else self.key


def _read_jsonl(path: Path, opener=open, label: str | None = None, key_by_id: bool = False) -> list[Document]:
    """One document per non-blank line. Records' "id" fields may be missing, null or repeated, so
    the split key is "label:line" (unique) unless `key_by_id` (the bundled corpus, unique ids)."""
    label = label or str(path)
    docs = []
    for lineno, record in jsonl_records(path, DataError, label, opener):
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(f"{label}:{lineno}: each JSONL line needs a string field 'text'")
        where = f"{label}:{lineno}"
        rid = record.get("id")
        doc_id = where if rid is None else str(rid)
        docs.append(Document(doc_id, record["text"], None if key_by_id else where))
    return docs


def _unreadable(path, e: OSError) -> DataError:
    return DataError(f"{path}: cannot read ({e.strerror or e})")


def _read_file(path: Path, root: Path) -> list[Document]:
    rel = str(path.relative_to(root)) if path != root else path.name
    try:
        if path.suffix == ".jsonl":
            return _read_jsonl(path, label=rel)
        return [Document(rel, path.read_text(encoding="utf-8"))]
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise _unreadable(path, e) from None


def _stat(path: Path) -> os.stat_result | None:
    """path.stat(), None where nothing is there. A path that cannot be looked at (a folder above it
    unreadable) is a DataError: Path.exists and is_file would call it missing or raise."""
    try:
        return path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise _unreadable(path, e) from None


def _corpus_files(root: Path) -> list[Path]:
    """Every *.txt and *.jsonl file under `root`, sorted. os.walk with an error handler, not rglob,
    which skips a folder it cannot list: an unreadable folder would read as an empty corpus."""
    def unreadable(e: OSError):
        raise _unreadable(e.filename, e)

    found = (Path(folder, name) for folder, _, names in os.walk(root, onerror=unreadable) for name in names)
    return sorted(p for p in found if p.suffix in (".txt", ".jsonl") and _is_regular(_stat(p)))


def _is_regular(st: os.stat_result | None) -> bool:
    return st is not None and stat.S_ISREG(st.st_mode)


def _split_paragraphs(doc: Document, pieces: int) -> list[Document]:
    """Cut one long text at blank lines into about `pieces` parts of similar size."""
    paragraphs = doc.text.split("\n\n")
    target = max(1, len(doc.text) // pieces)
    out, current = [], []
    size = 0
    for para in paragraphs:
        current.append(para)
        size += len(para) + 2
        if size >= target:
            out.append("\n\n".join(current))
            current, size = [], 0
    if current:
        out.append("\n\n".join(current))
    return [Document(f"{doc.id}#{i}", text, None if doc.key is None else f"{doc.key}#{i}")
            for i, text in enumerate(out)]


def load_documents(source: str | Path | None = None) -> list[Document]:
    """All documents of a source (see the module docstring); raises DataError when none has text."""
    if source is None:
        docs = _read_jsonl(BUNDLED, opener=lzma.open, label="bundled corpus", key_by_id=True)
        where = f"the bundled corpus {BUNDLED}"
    else:
        path = Path(source)
        found = _stat(path)
        if found is None:
            raise DataError(f"data path {str(source)!r} does not exist")
        where = str(path)
        if stat.S_ISDIR(found.st_mode):
            files = _corpus_files(path)
            if not files:
                raise DataError(f"empty corpus: no *.txt or *.jsonl files under {path}")
            docs = [d for f in files for d in _read_file(f, path)]
        else:
            docs = _read_file(path, path)
    docs = [d for d in docs if d.text.strip()]
    if not docs:
        raise DataError(f"empty corpus: no text in {where}")
    if len(docs) == 1:
        docs = _split_paragraphs(docs[0], SINGLE_DOC_PIECES)
        if len(docs) < 2:
            raise DataError(f"{where}: a single paragraph cannot be split into train and val documents")
    return docs


def split_documents(docs: list[Document], val_fraction: float) -> tuple[list[Document], list[Document]]:
    """(train, val): deterministic by split key, at least one document on each side.

    Membership is by position, not by key, so documents with equal ids or keys never collapse
    into one side (ties are broken by the text's hash, which keeps the split order-free)."""
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val fraction must be in (0, 1), got {val_fraction}")
    if len(docs) < 2:
        raise DataError(f"need at least 2 documents for a train/val split, got {len(docs)}")
    def rank(i: int) -> tuple[str, str]:
        d = docs[i]
        return hashlib.sha256(d.split_key.encode()).hexdigest(), hashlib.sha256(d.text.encode()).hexdigest()

    n_val = min(len(docs) - 1, max(1, math.ceil(val_fraction * len(docs))))
    val_idx = set(sorted(range(len(docs)), key=rank)[:n_val])
    # keep the source order inside each split (reading order; the sampler shuffles windows anyway)
    train = [d for i, d in enumerate(docs) if i not in val_idx]
    val = [d for i, d in enumerate(docs) if i in val_idx]
    if not train or not val:  # cannot happen for len(docs) >= 2; kept as a guard
        raise DataError(f"corpus of {len(docs)} documents is too small to split into train and val")
    return train, val
