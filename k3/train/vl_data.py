"""VL training data: generated scenes with questions -> K3 chat conversations with image placeholders
-> packed rows shared with text windows (DESIGN §7: the tower trains from scratch with the LM on mixed data).

A VL document is one scene of the shapes corpus (k3/data/shapes_corpus.py) and a few of its
questions as an XTML conversation (k3/text/xtml.py), rendered exactly as the server renders a chat
request (no bos; with thinking on, the server's default, the thinking-effort system message first):
    user: [the image's placeholders] q1      assistant: a1
    user: q2                                 assistant: a2   ...
The image part comes before the question's text, and only in the first user message, so the first
turn up to the assistant's reply is token for token the prompt of `/v1/chat/completions` for one
image + question request (`image`, then `text` content parts). The targets are the renderer's
loss mask, as `k3 sft` learns: each reply after its generation prompt (the empty think channel's
close, the response channel, the answer, the closing markers through `<|end_of_msg|>`).
With `describe`, a last turn asks for the scene cell by cell ("Scene: -, red circle, 7, ...") and
learns it whole (an option: it did not speed up learning the questions, docs/VISION.md).
Scene i of a run is drawn from `scene_rng(seed, i)`, a stream of its own ("k3-vl/train/{seed}/{i}";
the corpus's held-out split uses "k3-shapes/heldout/..."), so a step's documents are a pure
function of (seed, step) and resume needs no sampler state.
A packed row is the step's text windows (k3/train/packing.py, their own segments) followed by the VL
documents, one `cu_seqlens` segment each: no document sees another, text or image.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from functools import cache

import numpy as np
import torch
from PIL import Image
from tokenizers import Tokenizer

from k3.data import shapes_corpus as corpus
from k3.media.image_processor import ImageProcessor
from k3.text.tokenizer import MIN_VOCAB_SIZE, SPECIAL_TOKENS, train_tokenizer
from k3.text.xtml import IMAGE_PLACEHOLDER_TEXT, XTML, Rendered
from k3.train.packing import IGNORE_INDEX, TokenStream, window

DESCRIBE_QUESTION = "describe the scene cell by cell."
# what a chat request's image part looks like to the renderer (it reads the part's type only)
IMAGE_PART = {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}


@dataclass
class VLDoc:
    ids: np.ndarray  # [n] int64: the rendered conversation, the image's placeholders included
    mask: np.ndarray  # [n] bool: True on the tokens learned (each assistant reply after its generation prompt)
    pixel_values: torch.Tensor  # [L, 3, P, P] of its one image
    grid_thw: list[int]  # [t, h, w]
    answers: int  # assistant replies learned (the VL loss is a mean over replies)

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


def user_message(question: str, image: bool) -> dict:
    """A user turn as a chat request sends it: the image part (if any) first, then the question."""
    return {"role": "user", "content": ([IMAGE_PART] if image else []) + [{"type": "text", "text": question}]}


def conversation(qas: list[corpus.QA], description: str | None = None) -> list[dict]:
    """The scene's questions as chat turns, the image in the first user message only."""
    messages = []
    for i, qa in enumerate(qas):
        messages += [user_message(qa.question, image=i == 0), {"role": "assistant", "content": qa.answer}]
    if description is not None:
        messages += [user_message(DESCRIBE_QUESTION, image=False),
                     {"role": "assistant", "content": description}]
    return messages


@dataclass
class VLEncoder:
    """Tokens and pixels of VL documents and held-out prompts for one tokenizer and processor, in
    the XTML form the server renders (`thinking` as the request's chat_template_kwargs)."""
    tokenizer: Tokenizer
    processor: ImageProcessor
    placeholder_id: int
    thinking: bool = True
    chat: XTML = field(init=False, repr=False)

    def __post_init__(self):
        self.chat = XTML(self.tokenizer)  # ValueError naming the chat markers a tokenizer lacks

    def image(self, image: Image.Image) -> tuple[torch.Tensor, list[int], int]:
        return self.processor.preprocess_image(image)

    def render(self, messages: list[dict], placeholders: int, generation_prompt: bool) -> Rendered:
        return self.chat.render(messages, thinking=self.thinking, add_generation_prompt=generation_prompt,
                                media=[[self.placeholder_id] * placeholders])

    def prompt(self, question: str, placeholders: int) -> Rendered:
        """A one-question request's prompt, ending with the assistant's generation prompt."""
        return self.render([user_message(question, image=True)], placeholders, True)

    def prompt_ids(self, question: str, placeholders: int) -> list[int]:
        return self.prompt(question, placeholders).token_ids

    @property
    def reply_overhead(self) -> int:
        """Tokens of a reply besides its content: the markers from the generation prompt through end_of_msg."""
        rendered = self.chat.render([user_message("?", image=False), {"role": "assistant", "content": ""}],
                                    thinking=self.thinking, add_generation_prompt=False)
        return sum(rendered.loss_mask)

    def document(self, image: Image.Image, qas: list[corpus.QA], description: str | None = None) -> VLDoc:
        """One scene's conversation: its questions and learned answers, then (if given) the
        scene's description, learned whole."""
        if not qas:
            raise ValueError("a VL document needs at least one question")
        pixels, grid, count = self.image(image)
        rendered = self.render(conversation(qas, description), count, False)
        return VLDoc(np.asarray(rendered.token_ids, dtype=np.int64), np.asarray(rendered.loss_mask, dtype=bool),
                     pixels, grid, len(qas) + (description is not None))


def scene_rng(seed: int, index: int) -> random.Random:
    """The generator of training scene `index` (its own stream, so a step's data is a function of
    (seed, step) and resume is exact)."""
    return random.Random(f"k3-vl/train/{seed}/{index}")


def scene_questions(seed: int, index: int, questions: int, image_size: int) -> tuple[corpus.Scene, list[corpus.QA]]:
    """Scene `index` of the training stream and `questions` of its questions: types drawn uniformly
    without replacement among those the scene answers (as the corpus draws a held-out question's
    type), then one question of each type."""
    rng = scene_rng(seed, index)
    scene = corpus.make_scene(rng, image_size)
    pairs = corpus.qa_pairs(scene)
    types = [t for t in corpus.QUESTION_TYPES if any(p.qtype == t for p in pairs)]
    chosen = rng.sample(types, min(questions, len(types)))
    return scene, [rng.choice([p for p in pairs if p.qtype == t]) for t in chosen]


def describe(scene: corpus.Scene) -> str:
    """The scene cell by cell in raster order of the corpus's 3 x 3 grid: "Scene: -, red circle,
    7, ..." ("-" an empty cell, a digit as itself): every item's colour, kind and position."""
    items = ["-" if x is None else str(x) if isinstance(x, int) else f"{x.colour} {x.kind}" for x in scene.cells()]
    return "Scene: " + ", ".join(items)


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


@cache
def _text_renderer() -> XTML:
    """An XTML renderer over a bare tokenizer, for the text of conversations before the run's
    tokenizer exists (render_text needs the markers only)."""
    return XTML(train_tokenizer([], MIN_VOCAB_SIZE))


_PIECES = re.compile("|".join(re.escape(t) for t in (*SPECIAL_TOKENS.values(), IMAGE_PLACEHOLDER_TEXT)))


def corpus_texts(seed: int, scenes: int, image_size: int) -> list[str]:
    """The text between the chat markers of `scenes` scenes' conversations (every question, one
    turn each, thinking on and off) and their descriptions: the VL share of the tokenizer's
    training text, so the corpus's words and the markup's tag names are whole tokens."""
    chat = _text_renderer()
    out = []
    for i in range(scenes):
        rng = random.Random(f"k3-vl/tokenizer/{seed}/{i}")
        scene = corpus.make_scene(rng, image_size)
        for qa in corpus.qa_pairs(scene):
            for thinking in (True, False):
                text = chat.render_text(conversation([qa]), thinking=thinking, add_generation_prompt=False, images=True)
                out += [piece for piece in _PIECES.split(text) if piece]
        out.append(describe(scene))
    return out
