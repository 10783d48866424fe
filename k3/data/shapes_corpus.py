"""A procedural image-text corpus for joint vision-language training of a tiny model on the CPU.

Each scene is a small canvas (112 x 112 by default: 8 x 8 patches of 14, 16 placeholder tokens
after the 2 x 2 merge; 84 x 84 gives 6 x 6 and 9) on white, with 1-6 flat shapes (circle, square,
triangle) in 5 colours and, three times in four, one black digit 0-9 drawn from Pillow's built-in
bitmap font scaled up by whole pixels (no font files, no downloads). Items sit in distinct cells of
a 3 x 3 grid, so nothing overlaps, and shapes are drawn without anti-aliasing, so every pixel is
exactly a palette colour, the background or the ink: tests can count them.

Questions have one- or two-word answers:
  "how many shapes?" -> "1".."6"          "how many red shapes?" -> "0".."6"
  "what digit is shown?" -> "0".."9" / "none"
  "what colour is the circle?" -> a colour (asked only when there is exactly one circle)
  "is there a triangle?" -> "yes" / "no"

Splits (`examples`): example i of split S with seed k is drawn from its own `random.Random` seeded
with the string "k3-shapes/S/k/i", so "train" and "heldout" are independent streams (and any
prefix of a stream is stable whatever n is). Their images are distinct in practice (sizes and
positions jitter per shape), but facts and questions repeat across splits by design. With
`held_out_combos` (e.g. `HELD_OUT_COMBOS`), train scenes that have exactly `count` shapes of a
held-out `colour` are redrawn from the same stream, so those (colour, count) pairs never appear in
train, while "heldout" keeps them: `Example.novel` marks held-out questions whose answer is one.

The image goes where `IMAGE_PLACEHOLDER` stands in the prompt (`render_prompt`); mapping it to the
tokenizer's media placeholder ids is the trainer's business. `TextOnlyBaseline` answers from the
question alone (the majority answer per question, else per question type) as the bar an
image-reading model must clear.
"""
from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache

import numpy as np
from PIL import Image, ImageDraw, ImageFont

IMAGE_PLACEHOLDER = "<|media|>"
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "green": (30, 160, 60), "blue": (40, 90, 220), "yellow": (235, 200, 30),
    "purple": (140, 60, 180),
}
KINDS = ("circle", "square", "triangle")
BACKGROUND = (255, 255, 255)
INK = (0, 0, 0)
GRID = 3  # cells per side
MAX_SHAPES = 6
DIGIT_PROBABILITY = 0.75
QUESTION_TYPES = ("count_all", "count_colour", "digit", "colour_of", "exists")
HELD_OUT_COMBOS = frozenset({("red", 2), ("blue", 3), ("yellow", 1)})
SPLITS = ("train", "heldout")


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    box: tuple[int, int, int, int]  # x0, y0, x1, y1, inclusive

    @property
    def centre(self) -> tuple[int, int]:
        """A pixel inside the drawn shape (a triangle's centroid, apex up)."""
        x0, y0, x1, y1 = self.box
        return (x0 + x1) // 2, (y0 + 2 * y1) // 3 if self.kind == "triangle" else (y0 + y1) // 2


@dataclass
class Scene:
    image: Image.Image
    shapes: tuple[Shape, ...]
    digit: int | None
    digit_box: tuple[int, int, int, int] | None  # the scaled glyph's x0, y0, x1, y1 (x1, y1 exclusive)

    def count(self, colour: str | None = None, kind: str | None = None) -> int:
        return sum((colour is None or s.colour == colour) and (kind is None or s.kind == kind) for s in self.shapes)

    def cells(self) -> list[Shape | int | None]:
        """What each cell of the GRID x GRID grid holds, in raster order: a Shape, the digit, or None."""
        cell = self.image.width // GRID
        items: list[Shape | int | None] = [None] * GRID ** 2
        for shape in self.shapes:
            items[shape.box[1] // cell * GRID + shape.box[0] // cell] = shape
        if self.digit is not None:
            items[self.digit_box[1] // cell * GRID + self.digit_box[0] // cell] = self.digit
        return items


@dataclass(frozen=True)
class QA:
    qtype: str
    question: str
    answer: str


@dataclass
class Example:
    image: Image.Image
    question: str
    answer: str
    qtype: str
    scene: Scene
    novel: bool = False  # a held-out (colour, count) answer (only with held_out_combos)


@cache
def digit_glyph(digit: int, scale: int) -> Image.Image:
    """Mode "L" mask (255 = ink) of `digit` in Pillow's built-in bitmap font, each pixel scale x scale."""
    font = ImageFont.load_default_imagefont() if hasattr(ImageFont, "load_default_imagefont") else ImageFont.load_default()
    x0, y0, x1, y1 = font.getbbox(str(digit))
    small = Image.new("L", (x1 - x0, y1 - y0), 0)
    ImageDraw.Draw(small).text((-x0, -y0), str(digit), fill=255, font=font)
    mask = np.kron((np.asarray(small) > 127).astype(np.uint8), np.ones((scale, scale), dtype=np.uint8)) * 255
    return Image.fromarray(mask, mode="L")


def make_scene(rng: random.Random, size: int = 112, digit_probability: float = DIGIT_PROBABILITY) -> Scene:
    """One scene from `rng`: 1-6 shapes and maybe a digit, each in its own grid cell."""
    if size < 42:
        raise ValueError(f"a canvas of {size} px is too small for a {GRID} x {GRID} grid of shapes (>= 42)")
    cell = size // GRID
    n = rng.randint(1, MAX_SHAPES)
    digit = rng.randrange(10) if rng.random() < digit_probability else None
    cells = rng.sample(range(GRID * GRID), n + (digit is not None))
    image = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    shapes = []
    for c in cells[:n]:
        kind, colour = rng.choice(KINDS), rng.choice(tuple(COLOURS))
        side = rng.randint(int(cell * 0.55), int(cell * 0.8))
        x0 = (c % GRID) * cell + rng.randint(1, cell - side - 1)
        y0 = (c // GRID) * cell + rng.randint(1, cell - side - 1)
        box = (x0, y0, x0 + side - 1, y0 + side - 1)
        fill = COLOURS[colour]
        if kind == "circle":
            draw.ellipse(box, fill=fill)
        elif kind == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) / 2, box[1])], fill=fill)
        shapes.append(Shape(kind, colour, box))
    digit_box = None
    if digit is not None:
        glyph = digit_glyph(digit, max(1, (cell - 4) // 11))  # the font's digits are 11 px tall
        c = cells[n]
        x0 = (c % GRID) * cell + rng.randint(1, cell - glyph.width - 1)
        y0 = (c // GRID) * cell + rng.randint(1, cell - glyph.height - 1)
        draw.bitmap((x0, y0), glyph, fill=INK)
        digit_box = (x0, y0, x0 + glyph.width, y0 + glyph.height)
    return Scene(image, tuple(shapes), digit, digit_box)


def qa_pairs(scene: Scene) -> list[QA]:
    """Every question the scene answers, by type in `QUESTION_TYPES` order."""
    out = [QA("count_all", "how many shapes?", str(scene.count()))]
    out += [QA("count_colour", f"how many {c} shapes?", str(scene.count(colour=c))) for c in COLOURS]
    out.append(QA("digit", "what digit is shown?", "none" if scene.digit is None else str(scene.digit)))
    out += [QA("colour_of", f"what colour is the {k}?", next(s.colour for s in scene.shapes if s.kind == k))
            for k in KINDS if scene.count(kind=k) == 1]
    out += [QA("exists", f"is there a {k}?", "yes" if scene.count(kind=k) else "no") for k in KINDS]
    return out


def question_type(question: str) -> str:
    """The `QUESTION_TYPES` entry a question of `qa_pairs` belongs to."""
    if question == "how many shapes?":
        return "count_all"
    if question.startswith("how many "):
        return "count_colour"
    if question.startswith("what digit"):
        return "digit"
    if question.startswith("what colour"):
        return "colour_of"
    if question.startswith("is there"):
        return "exists"
    raise ValueError(f"not a shapes-corpus question: {question!r}")


def _has_combo(scene: Scene, combos: Iterable[tuple[str, int]]) -> bool:
    return any(scene.count(colour=c) == k for c, k in combos)


def examples(split: str, n: int, seed: int = 0, *, size: int = 112,
             held_out_combos: Iterable[tuple[str, int]] | None = None) -> Iterator[Example]:
    """`n` examples of `split` ("train" or "heldout"): one scene and one question each, the type
    uniform over `QUESTION_TYPES` (one with no question for the scene is drawn again)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    combos = frozenset(held_out_combos or ())
    for i in range(n):
        rng = random.Random(f"k3-shapes/{split}/{seed}/{i}")
        scene = make_scene(rng, size)
        while split == "train" and _has_combo(scene, combos):  # such scenes only in heldout
            scene = make_scene(rng, size)
        pairs = qa_pairs(scene)
        types = [t for t in QUESTION_TYPES if any(p.qtype == t for p in pairs)]
        qtype = rng.choice(types)
        qa = rng.choice([p for p in pairs if p.qtype == qtype])
        novel = qtype == "count_colour" and (qa.question.split()[2], int(qa.answer)) in combos
        yield Example(scene.image, qa.question, qa.answer, qtype, scene, novel)


def render_prompt(question: str) -> str:
    """The text around the image: the placeholder marker, the question, then "Answer:"."""
    return f"{IMAGE_PLACEHOLDER}\nQuestion: {question}\nAnswer:"


def render_example(example: Example) -> tuple[str, str]:
    """(prompt, target): the target is the answer after one space, to be trained on alone."""
    return render_prompt(example.question), f" {example.answer}"


class TextOnlyBaseline:
    """Answers without the image: the most common training answer to the same question, or to
    questions of the same type when the question was never seen (ties: the smallest answer)."""

    def __init__(self, train: Iterable[Example]):
        by_question: dict[str, Counter] = {}
        by_type: dict[str, Counter] = {}
        for ex in train:
            by_question.setdefault(ex.question, Counter())[ex.answer] += 1
            by_type.setdefault(ex.qtype, Counter())[ex.answer] += 1
        self.by_question = {q: _majority(c) for q, c in by_question.items()}
        self.by_type = {t: _majority(c) for t, c in by_type.items()}

    def answer(self, question: str) -> str:
        if question in self.by_question:
            return self.by_question[question]
        return self.by_type.get(question_type(question), "")

    def accuracy(self, data: Iterable[Example]) -> float:
        hits = [self.answer(ex.question) == ex.answer for ex in data]
        return sum(hits) / max(1, len(hits))


def _majority(counts: Counter) -> str:
    return min(counts, key=lambda a: (-counts[a], a))
