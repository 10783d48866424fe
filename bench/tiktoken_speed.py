"""Encode / decode throughput of a Kimi-style tiktoken.model folder: k3's converted `tokenizers`
BPE (what every verb uses, k3/text/tiktoken_folder.py) against the `tiktoken` library on the same
ranks, regex and specials, on ~10 MB of mixed-script text; ids are checked equal first.

  python -m bench.tiktoken_speed [--mb 10] [--vocab 8000] [--threads 1]

The ranks are a byte-level BPE trained here (the released 163,840-entry table is not bundled):
`--vocab` sets its size. Both libraries encode the text as one batch of 1 KB documents with
`--threads` threads (tiktoken's encode_ordinary_batch, tokenizers' encode_batch under
RAYON_NUM_THREADS).
"""
from __future__ import annotations

import argparse
import os
import random
import time


def mixed_text(mb: float, seed: int = 0) -> list[str]:
    """~`mb` MB of 1 KB documents: Shakespeare, CJK, emoji, code, digits and whitespace runs."""
    from k3.data.corpus import load_documents

    rng = random.Random(seed)
    english = "".join(d.text for d in load_documents(None)[:6])
    extra = ["日本語のテキストと漢字", "中文分词测试句子。", "한국어 문장입니다", "🙂🚀✨👩‍👩‍👧", "def f(x):\n    return x ** 2\n",
             "3.14159 2718281828 42", "   \t\n\n", "Ελληνικά русский עברית مرحبا"]
    docs, size = [], 0
    while size < mb * 1e6:
        start = rng.randrange(len(english) - 800)
        doc = english[start:start + 800] + "".join(rng.choice(extra) for _ in range(8))
        docs.append(doc)
        size += len(doc.encode())
    return docs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.tiktoken_speed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=10.0)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # before tokenizers starts its pool

    import tiktoken
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from k3.text import tiktoken_folder as tf

    docs = mixed_text(args.mb)
    nbytes = sum(len(d.encode()) for d in docs)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(docs[:2000], trainers.BpeTrainer(
        vocab_size=args.vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    ranks = tf.ranks_from_bpe(bpe)
    specials = {len(ranks) + i: f"<|reserved_token_{len(ranks) + i}|>" for i in range(tf.NUM_RESERVED_SPECIAL_TOKENS)}
    t0 = time.perf_counter()
    ours = tf.tokenizer_from_ranks(ranks, specials)
    convert = time.perf_counter() - t0
    ref = tiktoken.Encoding("bench", pat_str=tf.KIMI_PATTERN, mergeable_ranks=ranks,
                            special_tokens={t: i for i, t in specials.items()})

    def timed(fn):
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            out = fn()
            best = min(best, time.perf_counter() - t)
        return best, out

    t_ours, ids_ours = timed(lambda: [e.ids for e in ours.encode_batch(docs, add_special_tokens=False)])
    t_ref, ids_ref = timed(lambda: ref.encode_ordinary_batch(docs, num_threads=args.threads))
    assert ids_ours == ids_ref, "ids differ"
    d_ours, _ = timed(lambda: ours.decode_batch(ids_ours))
    d_ref, _ = timed(lambda: ref.decode_batch(ids_ref, num_threads=args.threads))
    ntok = sum(len(i) for i in ids_ours)
    print(f"{nbytes / 1e6:.1f} MB, {len(docs)} documents, {ntok:,} tokens, {len(ranks):,} ranks; ids equal; "
          f"conversion {convert:.2f} s; {args.threads} thread(s)")
    print(f"{'':12} {'encode MB/s':>12} {'decode MB/s':>12}")
    print(f"{'tokenizers':12} {nbytes / 1e6 / t_ours:12.1f} {nbytes / 1e6 / d_ours:12.1f}")
    print(f"{'tiktoken':12} {nbytes / 1e6 / t_ref:12.1f} {nbytes / 1e6 / d_ref:12.1f}")


if __name__ == "__main__":
    main()
