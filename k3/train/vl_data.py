"""VL training data: generated scenes with questions -> token ids with image placeholders -> packed
rows shared with text windows (SPEC §7: the tower trains from scratch with the LM on mixed data).

A VL document is one scene of the shapes corpus (k3/data/shapes_corpus.py) and a few of its
questions, each in the corpus's own prompt form (`render_prompt`, `render_example`):
    bos <|media|> x n  "\\nQuestion: q1\\nAnswer:" " a1" eos  "\\nQuestion: q2\\nAnswer:" " a2" eos ...
where n is the image's merged-row count (the processor's placeholder count) and the targets are the
answer tokens and the eos after each (so generation stops there): the first question is exactly a
held-out example's prompt, later ones reuse the image's tokens for more answers per scene. With
`describe`, the document ends with the scene cell by cell ("\nScene: -, red circle, 7, ...") + eos,
learned whole (an option: it did not speed up learning the questions, docs/VISION.md).
Scene i of a run is drawn from `random.Random(f"k3-vl/train/{seed}/{i}")` (the corpus's held-out split
uses "k3-shapes/heldout/...", an independent stream), so a step's documents are a pure function of
(seed, step) and resume needs no sampler state.
A packed row is the step's text windows (k3/train/packing.py, their own segments) followed by the VL
documents, one `cu_seqlens` segment each: no document sees another, text or image.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image
from tokenizers import Tokenizer

from k3.data import shapes_corpus as corpus
from k3.data.image_processor import ImageProcessor
from k3.train.packing import IGNORE_INDEX, TokenStream, window


@dataclass
class VLDoc:
    ids: np.ndarray  # [n] int64: bos, placeholders, questions and answers
    mask: np.ndarray  # [n] bool: True on the tokens learned (answers and the eos after each)
    pixel_values: torch.Tensor  # [L, 3, P, P] of its one image
    grid_thw: list[int]  # [t, h, w]

    @property
    def targets(self) -> int:
        return int(self.mask[1:].sum())


@dataclass
class VLBatch:
    input_ids: torch.Tensor  # [1, N]
    labels: torch.Tensor  # [1, N], IGNORE_INDEX where nothing is learned
    cu_seqlens: torch.Tensor  # [S + 1]
    is_vl: torch.Tensor  # [1, N] bool: the position belongs to a VL document
    pixel_values: torch.Tensor | None  # [L, 3, P, P] of the row's images in order, or None
    grid_thws: torch.Tensor | None  # [I, 3]

    def to(self, device) -> VLBatch:
        move = (lambda t: None if t is None else t.to(device))
        return VLBatch(*(move(t) for t in (self.input_ids, self.labels, self.cu_seqlens, self.is_vl,
                                           self.pixel_values, self.grid_thws)))


@dataclass
class VLEncoder:
    """Tokens and pixels of VL documents for one tokenizer and processor (encodings memoized: the
    corpus has a few dozen distinct questions and answers)."""
    tokenizer: Tokenizer
    processor: ImageProcessor
    bos_id: int
    eos_id: int
    placeholder_id: int
    _memo: dict = field(default_factory=dict, repr=False)

    def encode(self, text: str) -> list[int]:
        if text not in self._memo:
            self._memo[text] = self.tokenizer.encode(text, add_special_tokens=False).ids
        return self._memo[text]

    def image(self, image: Image.Image) -> tuple[torch.Tensor, list[int], int]:
        return self.processor.preprocess_image(image)

    def prompt_ids(self, question: str, placeholders: int) -> list[int]:
        """bos, the image's placeholders, then the corpus prompt's text after its image marker."""
        before, marker, after = corpus.render_prompt(question).partition(corpus.IMAGE_PLACEHOLDER)
        if not marker:
            raise ValueError(f"the corpus prompt has no {corpus.IMAGE_PLACEHOLDER!r} marker")
        return [self.bos_id, *self.encode(before), *[self.placeholder_id] * placeholders, *self.encode(after)]

    def document(self, image: Image.Image, qas: list[corpus.QA], description: str | None = None) -> VLDoc:
        """One scene's document: its image, then each question and its learned answer + eos, then
        (if given) the scene's description, learned whole, and an eos."""
        if not qas:
            raise ValueError("a VL document needs at least one question")
        pixels, grid, count = self.image(image)
        ids: list[int] = []
        mask: list[bool] = []
        for i, qa in enumerate(qas):
            prompt, target = corpus.render_example(corpus.Example(image, qa.question, qa.answer, qa.qtype, None))
            if i == 0:
                context = self.prompt_ids(qa.question, count)
            else:  # later questions: the prompt's text after the image marker only
                context = self.encode(prompt.partition(corpus.IMAGE_PLACEHOLDER)[2])
            answer = [*self.encode(target), self.eos_id]
            ids += context + answer
            mask += [False] * len(context) + [True] * len(answer)
        if description is not None:
            learned = [*self.encode(description), self.eos_id]
            ids += learned
            mask += [True] * len(learned)
        return VLDoc(np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool), pixels, grid)


def scene_questions(seed: int, index: int, questions: int, image_size: int) -> tuple[corpus.Scene, list[corpus.QA]]:
    """Scene `index` of the training stream and `questions` of its questions: types drawn uniformly
    without replacement among those the scene answers (as the corpus draws a held-out question's
    type), then one question of each type."""
    rng = random.Random(f"k3-vl/train/{seed}/{index}")
    scene = corpus.make_scene(rng, image_size)
    pairs = corpus.qa_pairs(scene)
    types = [t for t in corpus.QUESTION_TYPES if any(p.qtype == t for p in pairs)]
    chosen = rng.sample(types, min(questions, len(types)))
    return scene, [rng.choice([p for p in pairs if p.qtype == t]) for t in chosen]


def describe(scene: corpus.Scene) -> str:
    """The scene cell by cell in raster order of the corpus's 3 x 3 grid: "\nScene: -, red circle,
    7, ..." ("-" an empty cell, a digit as itself): every item's colour, kind and position."""
    cell = scene.image.width // corpus.GRID
    items = ["-"] * corpus.GRID ** 2
    for shape in scene.shapes:
        items[shape.box[1] // cell * corpus.GRID + shape.box[0] // cell] = f"{shape.colour} {shape.kind}"
    if scene.digit is not None:
        items[scene.digit_box[1] // cell * corpus.GRID + scene.digit_box[0] // cell] = str(scene.digit)
    return "\nScene: " + ", ".join(items)


def scenes_for_step(step: int, per_step: int) -> range:
    """Scene indices of optimizer step `step` (0-based): a fresh stretch of the endless stream."""
    return range(step * per_step, (step + 1) * per_step)


def pack_vl(stream: TokenStream | None, windows: list[int], seq_len: int, docs: list[VLDoc]) -> VLBatch:
    """Text windows (their own segments, k3.train.packing.window) then VL documents, one row."""
    xs, ys, vl, cu = [], [], [], []
    offset = 0
    for i in windows:
        x, y, starts = window(stream, i, seq_len)
        xs.append(x)
        ys.append(y)
        vl.append(np.zeros(len(x), dtype=bool))
        cu.extend(offset + s for s in starts)
        offset += len(x)
    for d in docs:
        xs.append(d.ids[:-1])
        ys.append(np.where(d.mask[1:], d.ids[1:], IGNORE_INDEX))
        vl.append(np.ones(len(d.ids) - 1, dtype=bool))
        cu.append(offset)
        offset += len(d.ids) - 1
    cu.append(offset)
    if not xs:
        raise ValueError("a packed row needs at least one text window or VL document")
    pixels = torch.cat([d.pixel_values for d in docs]) if docs else None
    grids = torch.tensor([d.grid_thw for d in docs], dtype=torch.long) if docs else None
    return VLBatch(torch.from_numpy(np.concatenate(xs))[None], torch.from_numpy(np.concatenate(ys))[None],
                   torch.tensor(cu, dtype=torch.long), torch.from_numpy(np.concatenate(vl))[None], pixels, grids)


def corpus_texts(seed: int, scenes: int, image_size: int) -> list[str]:
    """Question/answer text and the description of `scenes` scenes (every question each): the VL
    share of the tokenizer's training text, so the corpus's words are whole tokens."""
    out = []
    for i in range(scenes):
        rng = random.Random(f"k3-vl/tokenizer/{seed}/{i}")
        scene = corpus.make_scene(rng, image_size)
        for qa in corpus.qa_pairs(scene):
            prompt, target = corpus.render_example(corpus.Example(None, qa.question, qa.answer, qa.qtype, scene))
            out.append(prompt.replace(corpus.IMAGE_PLACEHOLDER, "") + target)
        out.append(describe(scene))
    return out
