"""The procedural shapes corpus (k3/data/shapes_corpus.py): determinism, split separation, the
pixels against the declared facts, and every answer re-derived from the pixels alone (connected
regions per colour, their fill ratio for the kind, the ink against each digit's glyph)."""
from __future__ import annotations

import hashlib
import random
import time

import numpy as np
import pytest

from k3.data import shapes_corpus as sc
from k3.media.image_processor import ImageProcessor
from tests.helpers.threads import one_torch_thread  # noqa: F401 (autouse fixture)


def _digest(image) -> str:
    return hashlib.sha256(image.tobytes()).hexdigest()


def _codes(px: np.ndarray) -> np.ndarray:
    """[H, W] int: one number per RGB colour."""
    return (px[..., 0].astype(np.int64) << 16) | (px[..., 1].astype(np.int64) << 8) | px[..., 2]


def _code(rgb: tuple[int, int, int]) -> int:
    return (rgb[0] << 16) | (rgb[1] << 8) | rgb[2]


def _regions(px: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(colour code, mask) of every 4-connected one-colour region of palette pixels: label
    propagation, each pixel taking the smallest label of its same-coloured neighbours."""
    code = _codes(px)
    mask = np.isin(code, [_code(c) for c in sc.COLOURS.values()])
    big = mask.size
    lab = np.where(mask, np.arange(big).reshape(mask.shape), big)
    vert = mask[1:] & mask[:-1] & (code[1:] == code[:-1])
    horiz = mask[:, 1:] & mask[:, :-1] & (code[:, 1:] == code[:, :-1])
    while True:
        new = lab.copy()
        new[1:] = np.where(vert, np.minimum(new[1:], lab[:-1]), new[1:])
        new[:-1] = np.where(vert, np.minimum(new[:-1], lab[1:]), new[:-1])
        new[:, 1:] = np.where(horiz, np.minimum(new[:, 1:], lab[:, :-1]), new[:, 1:])
        new[:, :-1] = np.where(horiz, np.minimum(new[:, :-1], lab[:, 1:]), new[:, :-1])
        if np.array_equal(new, lab):
            return [(int(code.flat[v]), lab == v) for v in np.unique(lab[mask])]
        lab = new


def _kind(region: np.ndarray) -> str:
    """square fills its bounding box, a circle about pi/4 of it, a triangle about half."""
    ys, xs = np.nonzero(region)
    fill = region.sum() / ((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))
    return "square" if fill > 0.92 else "circle" if fill > 0.65 else "triangle"


def _read_scene(image, size: int) -> tuple[list[tuple[str, str]], int | None]:
    """(kind, colour) of every shape and the digit, from the pixels alone."""
    px = np.asarray(image)
    names = {_code(rgb): name for name, rgb in sc.COLOURS.items()}
    shapes = [(_kind(region), names[code]) for code, region in _regions(px)]
    ink = (px == sc.INK).all(-1)
    if not ink.any():
        return shapes, None
    ys, xs = np.nonzero(ink)
    crop = ink[ys.min():ys.max() + 1, xs.min():xs.max() + 1]
    scale = max(1, (size // sc.GRID - 4) // 11)
    found = []
    for d in range(10):
        glyph = np.asarray(sc.digit_glyph(d, scale)) > 0
        gy, gx = np.nonzero(glyph)
        if np.array_equal(glyph[gy.min():gy.max() + 1, gx.min():gx.max() + 1], crop):
            found.append(d)
    assert len(found) == 1, found
    return shapes, found[0]


def test_deterministic_and_prefix_stable():
    a = list(sc.examples("train", 30, seed=3))
    b = list(sc.examples("train", 30, seed=3))
    c = list(sc.examples("train", 10, seed=3))
    key = [(_digest(e.image), e.question, e.answer) for e in a]
    assert key == [(_digest(e.image), e.question, e.answer) for e in b]
    assert key[:10] == [(_digest(e.image), e.question, e.answer) for e in c]
    other = [(_digest(e.image), e.question, e.answer) for e in sc.examples("train", 30, seed=4)]
    assert sum(x != y for x, y in zip(key, other)) >= 29
    scene1, scene2 = sc.make_scene(random.Random(7)), sc.make_scene(random.Random(7))
    assert _digest(scene1.image) == _digest(scene2.image) and scene1.shapes == scene2.shapes


def test_train_and_heldout_are_separate_streams():
    train = {_digest(e.image) for e in sc.examples("train", 300)}
    held = [_digest(e.image) for e in sc.examples("heldout", 300)]
    assert len(train) == 300 and len(set(held)) == 300 and not train & set(held)


@pytest.mark.parametrize("size", [112, 84])
def test_pixels_show_the_declared_facts(size):
    rng = random.Random(11)
    for _ in range(50):
        scene = sc.make_scene(rng, size)
        px = np.asarray(scene.image)
        assert scene.image.size == (size, size) and scene.image.mode == "RGB"
        # every pixel is the background, the ink, or a palette colour some declared shape has
        declared = {_code(sc.COLOURS[s.colour]) for s in scene.shapes} | {_code(sc.BACKGROUND)}
        assert set(np.unique(_codes(px)).tolist()) == declared | ({_code(sc.INK)} if scene.digit is not None else set())
        for colour, rgb in sc.COLOURS.items():
            mask = (px == rgb).all(-1)
            inside = np.zeros_like(mask)
            for s in scene.shapes:
                if s.colour == colour:
                    assert tuple(px[s.centre[1], s.centre[0]]) == rgb  # drawn where declared
                    inside[s.box[1]:s.box[3] + 1, s.box[0]:s.box[2] + 1] = True
            assert not (mask & ~inside).any()  # and nowhere else
        ink = (px == sc.INK).all(-1)
        if scene.digit is None:
            assert scene.digit_box is None and not ink.any()
        else:
            x0, y0, x1, y1 = scene.digit_box
            glyph = np.asarray(sc.digit_glyph(scene.digit, (size // sc.GRID - 4) // 11)) > 0
            assert np.array_equal(ink[y0:y1, x0:x1], glyph) and ink.sum() == glyph.sum()


def test_digit_glyphs_are_distinct():
    glyphs = [np.asarray(sc.digit_glyph(d, 3)) for d in range(10)]
    assert all(g.any() for g in glyphs)
    assert len({g.tobytes() for g in glyphs}) == 10


def test_answers_follow_from_the_pixels():
    seen_types = set()
    for size in (112, 84):
        for ex in sc.examples("train", 100, seed=size, size=size):
            shapes, digit = _read_scene(ex.image, size)
            assert sorted(shapes) == sorted((s.kind, s.colour) for s in ex.scene.shapes)
            assert digit == ex.scene.digit
            for qa in sc.qa_pairs(ex.scene):
                words = qa.question.rstrip("?").split()
                if qa.qtype == "count_all":
                    expect = str(len(shapes))
                elif qa.qtype == "count_colour":
                    expect = str(sum(c == words[2] for _, c in shapes))
                elif qa.qtype == "digit":
                    expect = "none" if digit is None else str(digit)
                elif qa.qtype == "colour_of":
                    (expect,) = [c for k, c in shapes if k == words[-1]]
                else:
                    expect = "yes" if any(k == words[-1] for k, _ in shapes) else "no"
                assert qa.answer == expect, (qa, shapes, digit)
                assert sc.question_type(qa.question) == qa.qtype
            assert (ex.qtype, ex.question, ex.answer) in {(p.qtype, p.question, p.answer) for p in sc.qa_pairs(ex.scene)}
            seen_types.add(ex.qtype)
    assert seen_types == set(sc.QUESTION_TYPES)


def test_held_out_combinations():
    combos = sc.HELD_OUT_COMBOS
    train = list(sc.examples("train", 300, held_out_combos=combos))
    assert not any(ex.scene.count(colour=c) == k for ex in train for c, k in combos)
    assert not any(ex.novel for ex in train)
    held = list(sc.examples("heldout", 300, held_out_combos=combos))
    novel = [ex for ex in held if ex.novel]
    assert novel and all(ex.qtype == "count_colour" for ex in novel)
    assert all((ex.question.split()[2], int(ex.answer)) in combos for ex in novel)
    # without combos the train stream is unchanged by the option's existence
    plain = [_digest(e.image) for e in sc.examples("train", 20)]
    assert plain == [_digest(e.image) for e in sc.examples("train", 20, held_out_combos=None)]


def test_prompt_and_text_only_baseline():
    ex = next(sc.examples("train", 1))
    prompt, target = sc.render_example(ex)
    assert prompt.count(sc.IMAGE_PLACEHOLDER) == 1 and prompt.startswith(sc.IMAGE_PLACEHOLDER)
    assert ex.question in prompt and prompt.endswith("Answer:") and target == f" {ex.answer}"
    # by hand: majority per question, ties to the smallest answer, unseen question -> its type's majority
    def mk(q: str, a: str) -> sc.Example:
        return sc.Example(ex.image, q, a, sc.question_type(q), ex.scene)

    base = sc.TextOnlyBaseline([mk("how many red shapes?", "1"), mk("how many red shapes?", "0"),
                                mk("how many blue shapes?", "2"), mk("how many blue shapes?", "2"),
                                mk("is there a circle?", "yes")])
    assert base.answer("how many red shapes?") == "0" and base.answer("how many blue shapes?") == "2"
    assert base.answer("how many green shapes?") == "2" and base.answer("is there a square?") == "yes"
    assert base.accuracy([mk("how many red shapes?", "0"), mk("is there a square?", "no")]) == 0.5
    # the bar a model must clear on held-out data: far from perfect without the image
    model = sc.TextOnlyBaseline(sc.examples("train", 500))
    assert 0.2 < model.accuracy(sc.examples("heldout", 300)) < 0.5


@pytest.mark.parametrize("size,side", [(112, 8), (84, 6)])
def test_scenes_through_the_processor(size, side):
    images = [e.image for e in sc.examples("train", 4, size=size)]
    out = ImageProcessor()(images)
    assert out.grid_thws.tolist() == [[1, side, side]] * 4  # kept at its size: side * side <= 64 patches
    assert out.pixel_values.shape == (4 * side * side, 3, 14, 14) and out.num_placeholders == [side * side // 4] * 4


def test_fast_and_errors():
    start = time.perf_counter()
    assert len(list(sc.examples("train", 1000))) == 1000
    assert time.perf_counter() - start < 2.0
    with pytest.raises(ValueError, match="split must be one of"):
        next(sc.examples("test", 1))
    with pytest.raises(ValueError, match="too small"):
        sc.make_scene(random.Random(0), 30)
    with pytest.raises(ValueError, match="not a shapes-corpus question"):
        sc.question_type("why?")
