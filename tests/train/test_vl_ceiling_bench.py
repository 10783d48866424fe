"""bench/vl_ceiling.py's fact features: each merged row of a packed batch is its own cell's fact
vector (shapes and digits composed from shared parts), a blank canvas is all empty cells, and the
run's chat prompts carry them through VLTrainer's own encoder."""
from __future__ import annotations

import random

import torch

from bench.vl_ceiling import CODES, DIGITS, EMPTY, SHAPES, FactFeatures, cell_codes, fact_table
from k3.data import shapes_corpus as corpus
from k3.media.image_processor import ImageProcessor
from k3.train.vl_config import load_vl_config


def test_fact_rows_follow_the_cells_of_each_packed_image():
    cfg = load_vl_config("k3-tiny-vl")
    model = FactFeatures(cfg)
    processor = ImageProcessor.from_vision_config(cfg.vision_config)
    scenes = [corpus.make_scene(random.Random(i), 84) for i in range(3)]
    pixels, grids, codes = [], [], []
    for scene in scenes:
        p, grid, count = processor.preprocess_image(scene.image)
        assert count == 9
        p = torch.zeros_like(p)
        p[:count, 0, 0, 0] = torch.tensor(cell_codes(scene), dtype=p.dtype)
        pixels.append(p)
        grids.append(grid)
        codes += cell_codes(scene)
    rows = model.image_features(torch.cat(pixels), torch.tensor(grids))
    assert torch.equal(rows, fact_table(cfg.text_config.hidden_size)[torch.tensor(codes)])
    for scene in scenes:  # every item sits in its own cell, and the codes say what it is
        c = cell_codes(scene)
        assert sum(x >= SHAPES for x in c) == len(scene.shapes)
        assert (scene.digit is None) == (not any(DIGITS <= x < SHAPES for x in c))
    table = fact_table(16)
    assert table.shape == (CODES, 16) and not table[EMPTY].any()
    # composed: the difference between a red and a blue item is the same whatever their kind
    red_circle, red_square, blue_circle, blue_square = (SHAPES + 3 * c + k for c, k in ((0, 0), (0, 1), (2, 0), (2, 1)))
    assert torch.allclose(table[red_circle] - table[blue_circle], table[red_square] - table[blue_square], atol=1e-6)
    assert not torch.allclose(table[red_circle], table[red_square])
