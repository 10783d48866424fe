"""Which half limits joint VL training (docs/VISION.md "Joint training"): the `k3-tiny-vl` run with
the vision tower replaced by the scene's own facts (the text model's ceiling), and runs of one
question type.

    python -m bench.vl_ceiling [--features tower|oracle] [--only TYPE] [--steps 560] [--scenes 11]
                               [--questions 4] [--lr 4e-3] [--tower-lr-scale 1] [--pos-std S]
                               [--freeze-tower] [--eval-every N] [--device cuda] [--out DIR]

--features oracle: each merged row (one cell of the corpus's 3 x 3 grid at 84 px) is a fixed random
vector composed from the cell's facts, as a trained tower's feature could be: an empty cell 0, a
shape s + c[colour] + k[kind], a digit d + g[digit] (every part N(0, 1/2) per coordinate, seed 1).
The facts are distinct and compositional from step 0, so what the run learns is the text model's
part. The pixels the trainer passes carry each row's fact code in their first value (the tower never
runs); a blank canvas (the blank-image baseline) gets empty cells. --features tower: the run as
`k3 train --config k3-tiny-vl` makes it. --only TYPE: every question of the run and of the held-out
set is of one type (k3.data.shapes_corpus.QUESTION_TYPES), one per scene. Everything else is
VLTrainer's (data, optimizer, schedule, chat form, held-out eval through the server's prompt).
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time

from k3.threads import configure

if __name__ == "__main__":  # before torch loads: the threads `k3 train` would pick (k3/threads.py)
    configure()

import torch
from PIL import Image

from k3.data import shapes_corpus as corpus
from k3.model.multimodal import K3ForConditionalGeneration
from k3.train.vl_data import scene_questions, scene_rng
from k3.train.vl_trainer import VLSettings, VLTrainer

EMPTY, DIGITS, SHAPES = 0, 1, 11  # fact codes: empty cell, 1 + digit, 11 + 3 * colour + kind
CODES = SHAPES + len(corpus.COLOURS) * len(corpus.KINDS)


def fact_table(dim: int, seed: int = 1) -> torch.Tensor:
    """[CODES, dim]: row c is the feature of fact code c, composed from shared parts."""
    parts = torch.randn(20, dim, generator=torch.Generator().manual_seed(seed)) / 2 ** 0.5
    shape, colours, kinds, digit, glyphs = parts[0], parts[1:6], parts[6:9], parts[9], parts[10:20]
    rows = [torch.zeros(dim)] + [digit + glyphs[d] for d in range(10)]
    rows += [shape + colours[c] + kinds[k] for c in range(len(corpus.COLOURS)) for k in range(len(corpus.KINDS))]
    return torch.stack(rows)


def cell_codes(scene: corpus.Scene) -> list[int]:
    """The fact code of each cell in raster order (at 84 px, each cell is one merged row, in that order)."""
    colours = list(corpus.COLOURS)
    return [EMPTY if x is None else DIGITS + x if isinstance(x, int) else
            SHAPES + colours.index(x.colour) * len(corpus.KINDS) + corpus.KINDS.index(x.kind) for x in scene.cells()]


class FactFeatures(K3ForConditionalGeneration):
    """The multimodal model with image_features read from the fact table instead of the tower."""

    def __init__(self, config):
        super().__init__(config)
        self.register_buffer("facts", fact_table(config.text_config.hidden_size), persistent=False)

    def image_features(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        rows = self.placeholder_counts(grid_thws)
        patches = [int(t * h * w) for t, h, w in grid_thws.tolist()]
        starts = torch.tensor([0] + patches).cumsum(0).tolist()
        codes = [pixel_values[start:start + n, 0, 0, 0] for start, n in zip(starts, rows)]
        return self.facts[torch.cat(codes).round().long().clamp(0, CODES - 1)]


class CeilingTrainer(VLTrainer):
    """VLTrainer with fact features (`oracle`), one question type (`only`), and the tower's position
    table drawn at `pos_std` or the tower frozen."""
    oracle = False
    only: str | None = None
    pos_std: float | None = None
    freeze_tower = False

    def _new_model(self):
        model = FactFeatures(self.mm_config) if self.oracle else super()._new_model()
        if self.pos_std is not None:  # the position table's draw (official: N(0, 1))
            torch.nn.init.normal_(model.vision_tower.patch_embed.pos_emb.weight, std=self.pos_std)
        if self.freeze_tower:  # the tower stays as drawn; the projector still trains
            model.vision_tower.requires_grad_(False)
        return model

    def _setup_data(self, settings, config, resume):
        super()._setup_data(settings, config, resume)
        if self.only:
            pool = corpus.examples("heldout", 20 * settings.vqa_eval, settings.seed, size=settings.image_size)
            self.heldout = [ex for ex in pool if ex.qtype == self.only][:settings.vqa_eval]
        if self.oracle:
            scenes = {id(ex.image): ex.scene for ex in self.heldout}
            encode = self.encoder.image

            def image(img: Image.Image):
                pixels, grid, count = encode(img)
                pixels = torch.zeros_like(pixels)  # a blank canvas (not a scene) has empty cells
                if id(img) in scenes:
                    pixels[:count, 0, 0, 0] = torch.tensor(cell_codes(scenes[id(img)]), dtype=pixels.dtype)
                return pixels, grid, count

            self.encoder.image, self._scenes = image, scenes

    def documents(self, indices: list[int]) -> list:
        s, docs = self.s, []
        for i in indices:
            if self.only:
                rng, qas = scene_rng(s.seed, i), []
                while not qas:  # a scene that has a question of the type (colour_of needs a lone kind)
                    scene = corpus.make_scene(rng, s.image_size)
                    qas = [p for p in corpus.qa_pairs(scene) if p.qtype == self.only]
                qas = [rng.choice(qas)]
            else:
                scene, qas = scene_questions(s.seed, i, s.vl_questions, s.image_size)
            if self.oracle:
                self._scenes[id(scene.image)] = scene
            docs.append(self.encoder.document(scene.image, qas))
            if self.oracle:
                del self._scenes[id(scene.image)]
        return docs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--features", choices=("tower", "oracle"), default="oracle")
    ap.add_argument("--only", choices=corpus.QUESTION_TYPES)
    ap.add_argument("--steps", type=int, default=560)
    ap.add_argument("--scenes", type=int, default=11)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--lr", type=float, default=4e-3)
    ap.add_argument("--tower-lr-scale", type=float, default=1.0, help="the tower's and projector's lr over --lr")
    ap.add_argument("--pos-std", type=float, help="draw the tower's position table at this std (official: 1)")
    ap.add_argument("--freeze-tower", action="store_true", help="train the projector but not the tower")
    ap.add_argument("--eval-every", type=int, help="held-out eval every N steps (default: half the run)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", help="run folder (default: a temporary one, removed)")
    args = ap.parse_args()
    CeilingTrainer.oracle, CeilingTrainer.only = args.features == "oracle", args.only
    CeilingTrainer.pos_std, CeilingTrainer.freeze_tower = args.pos_std, args.freeze_tower
    out = args.out or tempfile.mkdtemp(prefix="vl_ceiling-")
    s = VLSettings(out=out, steps=args.steps, vl_scenes=args.scenes, vl_questions=args.questions, lr=args.lr,
                   vision_lr_scale=args.tower_lr_scale, eval_every=args.eval_every or args.steps // 2,
                   ckpt_every=10 ** 9, device=args.device)
    t0 = time.perf_counter()
    try:
        result = CeilingTrainer(s, progress=True).train()
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)
    v = result["vqa"]
    types = " / ".join(f"{t} {100 * a:.1f}" for t, a in v["by_type"].items())
    print(f"features {args.features}, only {args.only or 'all'}, {args.steps} steps x {args.scenes} scenes x "
          f"{args.questions if not args.only else 1} questions: held-out {100 * v['accuracy']:.1f}% ({types}); "
          f"blank images {100 * v['blank_image_accuracy']:.1f}%, majority {100 * v['majority_accuracy']:.1f}%; "
          f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
