"""The image/video processor (k3/media/image_processor.py): resize sizes and patch layout against
transformers 5.24's Kimi-K2.5 processors (same rule and layout as K3's), K3's own sizes as public
ports of its processor report them, pixels by hand, the budget, clips, and the errors.

transformers' `kimi_k25` image/video processor modules import torchvision, which this machine does
not have, so their pure functions (`navit_resize`, the two `patchify` methods) are read from the
installed source and run alone; the tests skip where transformers is absent."""
from __future__ import annotations

import ast
import importlib.util
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from k3.media.image_processor import K3_MEDIA_PROC_CFG, ImageProcessor
from k3.model.vision.merge import merged_counts
from tests.helpers.threads import one_torch_thread  # noqa: F401 (autouse fixture)


@pytest.fixture(scope="module")
def k25(tmp_path_factory) -> dict:
    """`navit_resize`, `image_patchify`, `video_patchify` from transformers' installed kimi_k25
    source: the functions alone, written to a module of their own and imported."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        pytest.skip("transformers is not installed")
    folder = Path(spec.origin).parent / "models" / "kimi_k25"
    out: dict = {}
    for file, cls, key in (("image_processing_kimi_k25.py", "Kimi_K25ImageProcessor", "image_patchify"),
                           ("video_processing_kimi_k25.py", "Kimi_K25VideoProcessor", "video_patchify")):
        if not (folder / file).exists():
            pytest.skip(f"transformers has no {file}")
        tree = ast.parse((folder / file).read_text())
        nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "navit_resize"]
        nodes += [m for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls
                  for m in n.body if isinstance(m, ast.FunctionDef) and m.name == "patchify"]
        path = tmp_path_factory.mktemp("k25") / f"extracted_{key}.py"
        path.write_text("import math\nimport torch\n\n" + ast.unparse(ast.Module(body=nodes, type_ignores=[])))
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        out.setdefault("navit_resize", module.navit_resize)
        out[key] = module.patchify
    return out


def _normalized(image: Image.Image, padded: tuple[int, int]) -> torch.Tensor:
    """[3, H, W]: the image padded right/bottom with black to `padded` (w, h), then (x/255 - .5)/.5."""
    arr = np.zeros((padded[1], padded[0], 3), dtype=np.uint8)
    arr[:image.height, :image.width] = np.asarray(image.convert("RGB"))
    return ((torch.from_numpy(arr).float() / 255.0 - 0.5) * 2.0).permute(2, 0, 1)


def _random_image(w: int, h: int, seed: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).convert(mode)


SIZES = [(1, 1), (13, 14), (28, 28), (29, 57), (100, 100), (640, 480), (1023, 77), (4000, 3000), (10000, 100),
         (8000, 8000), (1861, 7041), (7168, 7168), (3, 9000)]


@pytest.mark.parametrize("budget,side", [(65536, 512), (16384, 512), (4096, 64), (256, 16)])
def test_resize_sizes_match_transformers_kimi_k25(k25, budget, side):
    navit_resize = k25["navit_resize"]
    proc = ImageProcessor(max_patches=budget, max_patches_per_side=side, strict_budget=False)
    rng = random.Random(budget)
    sizes = SIZES + [(rng.randint(1, 9000), rng.randint(1, 9000)) for _ in range(200)]
    for w, h in sizes:
        (new_h, new_w), (pad_h, pad_w) = navit_resize(h, w, 14, 2, budget, side)
        plan = proc.plan(w, h)
        assert (plan.width, plan.height, plan.padded_size) == (new_w, new_h, (pad_w, pad_h)), (w, h)
        if plan.num_patches <= budget:  # where the official size fits, the strict one is the same
            assert ImageProcessor(max_patches=budget, max_patches_per_side=side).plan(w, h) == plan


def test_k3_sizes_as_public_ports_of_its_processor_report_them():
    # (w, h) -> resized (w, h), padded (w, h), placeholder tokens: the official rule, strict_budget off
    expect = {(4000, 3000): ((4000, 3000), (4004, 3024), 15444), (10000, 100): ((7168, 71), (7168, 84), 768),
              (100, 100): ((100, 100), (112, 112), 16), (8000, 8000): ((3586, 3586), (3612, 3612), 16641),
              (1861, 7041): ((1850, 7002), (1876, 7028), 16817), (30, 16): ((30, 16), (56, 28), 2)}
    official = ImageProcessor(strict_budget=False)
    for (w, h), (size, padded, tokens) in expect.items():
        plan = official.plan(w, h)
        assert ((plan.width, plan.height), plan.padded_size, official.placeholders(plan)) == (size, padded, tokens)
    # the official grid can pass the 65,536-patch budget through padding; the strict default stays under
    strict = ImageProcessor()
    for w, h in [(8000, 8000), (1861, 7041)]:
        assert official.plan(w, h).num_patches > 65536
        plan = strict.plan(w, h)
        assert plan.num_patches <= 65536 and strict.placeholders(plan) >= 16300


def test_patch_layout_matches_transformers_kimi_k25(k25):
    fns = k25
    proc = ImageProcessor()
    for w, h in [(30, 16), (56, 28), (83, 41), (112, 112)]:  # sizes under the budget: no resize, so pixels compare
        image = _random_image(w, h, seed=w)
        patches, grid, count = proc.preprocess_image(image)
        plan = proc.plan(w, h)
        ref, gh, gw = fns["image_patchify"](None, _normalized(image, plan.padded_size)[None], 14)
        assert grid == [1, gh, gw] and count == (gh // 2) * (gw // 2)
        assert torch.allclose(patches, ref[0], atol=1e-6, rtol=0)
    frames = [_random_image(41, 30, seed=i) for i in range(3)]
    clip = ImageProcessor(pad_last_clip=False).preprocess_video(frames)
    assert len(clip) == 1
    video = torch.stack([_normalized(f, (56, 56)) for f in frames])[None]
    ref, t, gh, gw = fns["video_patchify"](None, video.contiguous(), 14)
    assert clip[0][1] == [t, gh, gw] == [3, 4, 4]
    assert torch.allclose(clip[0][0], ref[0], atol=1e-6, rtol=0)


def test_pixels_by_hand():
    # 30 x 16: left half red, right half blue; kept at its size, padded with black to 56 x 28
    arr = np.zeros((16, 30, 3), dtype=np.uint8)
    arr[:, :15, 0] = 255
    arr[:, 15:, 2] = 255
    arr[0, 0] = (51, 102, 204)
    out = ImageProcessor()(Image.fromarray(arr))
    patches = out.pixel_values
    assert out.grid_thws.tolist() == [[1, 2, 4]] and out.num_placeholders == [2]
    assert patches.shape == (8, 3, 14, 14) and patches.dtype == torch.float32
    assert patches[0, :, 0, 0].tolist() == pytest.approx([51 / 127.5 - 1, 102 / 127.5 - 1, 204 / 127.5 - 1], abs=1e-6)
    assert patches[0, :, 5, 5].tolist() == [1.0, -1.0, -1.0]  # red
    assert patches[2, :, 0, 0].tolist() == [-1.0, -1.0, 1.0]  # patch (row 0, col 2): x = 28, blue
    assert patches[2, :, 0, 2].tolist() == [-1.0] * 3  # x = 30: padding
    assert patches[4, :, 1, 0].tolist() == [1.0, -1.0, -1.0]  # patch (row 1, col 0): y = 15, red
    assert patches[4, :, 2, 0].tolist() == [-1.0] * 3  # y = 16: padding
    # resized (bicubic of a constant stays that constant) and deterministic
    big = Image.new("RGB", (3000, 900), (255, 0, 0))
    small = ImageProcessor(max_patches=256)
    a, b = small(big), small(big)
    assert torch.equal(a.pixel_values, b.pixel_values)
    plan = small.plan(3000, 900)
    image = a.pixel_values.reshape(plan.grid_h, plan.grid_w, 3, 14, 14).permute(2, 0, 3, 1, 4)
    image = image.reshape(3, plan.grid_h * 14, plan.grid_w * 14)
    assert (image[:, :plan.height, :plan.width] == torch.tensor([1.0, -1.0, -1.0])[:, None, None]).all()
    assert (image[:, plan.height:] == -1).all() and (image[:, :, plan.width:] == -1).all()


def test_modes_and_transparency():
    proc = ImageProcessor()
    base = _random_image(20, 20, seed=3)
    for mode in ("L", "P", "CMYK", "YCbCr", "1", "RGBX"):
        image = base.convert(mode)
        expect = _normalized(image.convert("RGB"), (28, 28))
        got = proc(image).pixel_values.reshape(2, 2, 3, 14, 14).permute(2, 0, 3, 1, 4).reshape(3, 28, 28)
        assert torch.allclose(got, expect, atol=1e-6), mode
    # transparent pixels land on K3's chessboard: 8 px squares, white (255) top-left, gray 180
    clear = proc(Image.new("RGBA", (60, 60), (0, 0, 0, 0))).pixel_values
    assert clear[0, :, 0, 0].tolist() == [1.0] * 3
    assert clear[0, :, 0, 8].tolist() == pytest.approx([180 / 127.5 - 1] * 3, abs=1e-6)
    assert clear[0, :, 8, 8].tolist() == [1.0] * 3
    # half alpha: 40 over white -> 147, over gray -> 109 (float32 blend, truncated)
    half = proc(Image.new("RGBA", (16, 16), (40, 40, 40, 128))).pixel_values
    assert half[0, 0, 0, 0].item() == pytest.approx(147 / 127.5 - 1, abs=1e-6)
    assert half[0, 0, 0, 8].item() == pytest.approx(109 / 127.5 - 1, abs=1e-6)
    # colour-key transparency (a PNG tRNS chunk) is transparency in RGB as in L
    for mode, key in (("RGB", (0, 0, 0)), ("L", 0)):
        keyed = Image.new(mode, (28, 28), key)
        keyed.info["transparency"] = key
        assert proc(keyed).pixel_values[0, :, 0, 0].tolist() == [1.0] * 3, mode  # the board's white
    # no background: alpha dropped, black stays black
    plain = ImageProcessor(transparent_background=None)(Image.new("RGBA", (28, 28), (0, 0, 0, 0))).pixel_values
    assert (plain == -1).all()


def test_aspect_ratio_grid_and_budget():
    rng = random.Random(0)
    for budget, minimum in [(64, 16), (256, 4), (1024, 64), (16384, 4)]:
        proc = ImageProcessor(max_patches=budget, min_patches=minimum)
        for _ in range(150):
            w, h = rng.randint(1, 3000), rng.randint(1, 3000)
            if max(w, h) / min(w, h) > 4:
                w = h = max(w, h)
            plan = proc.plan(w, h)
            assert plan.grid_h % 2 == 0 and plan.grid_w % 2 == 0
            assert minimum <= plan.num_patches <= budget, (w, h, plan)
            assert abs(plan.height - h * plan.width / w) <= 14, (w, h, plan)  # aspect within a patch
            pad_w, pad_h = plan.padded_size
            assert 0 <= pad_w - plan.width < 28 and 0 <= pad_h - plan.height < 28
            assert proc.placeholders(plan) * 4 == plan.num_patches
    # the minimum upscales a small image (the official rule never does)
    plan = ImageProcessor(min_patches=64).plan(20, 20)
    assert plan.num_patches >= 64 and plan.width == plan.height > 20


def test_placeholders_equal_the_towers_merged_rows():
    from tests.model.vision.helpers import tiny_model

    model = tiny_model()  # patch 4, 2 x 2 merge, 4-frame table
    proc = ImageProcessor.from_vision_config(model.config, max_patches=64, max_patches_per_frame=32)
    media = [_random_image(10, 7, 1), [_random_image(9, 9, i) for i in range(5)], _random_image(40, 90, 2)]
    out = proc(media)
    assert out.media_index == [0, 1, 1, 2]
    assert out.grid_thws[:, 0].tolist() == [1, 4, 4, 1]
    assert merged_counts(out.grid_thws, model.config.merge_kernel_size) == out.num_placeholders
    assert [proc.placeholder_counts(m) for m in media] == [[n] for n in out.num_placeholders[:1]] + [
        out.num_placeholders[1:3], out.num_placeholders[3:]]
    assert out.placeholders_per_media() == [out.num_placeholders[0], sum(out.num_placeholders[1:3]),
                                            out.num_placeholders[3]]
    with torch.no_grad():
        assert model(out.pixel_values, out.grid_thws).shape[0] == sum(out.num_placeholders)


def test_video_clips():
    frames = [_random_image(30, 20, seed=i) for i in range(10)]
    proc = ImageProcessor()
    clips = proc.preprocess_video(frames)
    assert [c[1] for c in clips] == [[4, 2, 4]] * 3 and [c[2] for c in clips] == [2, 2, 2]
    per_frame = 8
    last = clips[2][0].reshape(4, per_frame, 3, 14, 14)
    assert torch.equal(last[2], last[1]) and torch.equal(last[3], last[1])  # frame 9 repeated
    assert torch.equal(last[1], proc.preprocess_image(frames[9])[0])
    assert torch.equal(clips[0][0].reshape(4, per_frame, 3, 14, 14)[2], proc.preprocess_image(frames[2])[0])
    short = ImageProcessor(pad_last_clip=False).preprocess_video(frames)
    assert [c[1][0] for c in short] == [4, 4, 2]
    assert torch.equal(short[2][0], clips[2][0][:2 * per_frame])
    # the video's patch budget is shared by its frames: 40 frames of 700 x 700 at 64 patches a video
    tight = ImageProcessor(max_patches_per_frame=256, max_patches_per_video=64 * 40 // 4)
    assert tight.frame_budget(40) == 16 and tight.frame_budget(4) == 160
    plan = tight.plan(700, 700, tight.frame_budget(40))
    assert plan.num_patches <= 16
    assert tight.placeholder_counts([Image.new("RGB", (700, 700))] * 40) == [tight.placeholders(plan)] * 10


def test_media_proc_cfg():
    assert vars(ImageProcessor.from_media_proc_cfg({"media_proc_cfg": K3_MEDIA_PROC_CFG})) == vars(ImageProcessor())
    k25 = {"in_patch_limit": 16384, "patch_limit_on_one_side": 512, "in_patch_limit_each_frame": 4096,
           "in_patch_limit_video": None, "temporal_merge_kernel_size": 4, "merge_kernel_size": [2, 2],
           "sample_fps": 2.0, "transparent_bg_config": None}
    proc = ImageProcessor.from_media_proc_cfg(k25)
    assert (proc.max_patches, proc.max_patches_per_frame, proc.max_patches_per_video) == (16384, 4096, None)
    assert proc.transparent_background is None and proc.merge_kernel_size == (2, 2)
    with pytest.raises(ValueError, match="fixed_output_tokens"):
        ImageProcessor.from_media_proc_cfg({"fixed_output_tokens": 256})


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert msg and "\n" not in msg
    return msg


def test_bad_inputs_raise_one_line_errors():
    proc = ImageProcessor(max_pixels=10_000, max_frames=8)
    ok = Image.new("RGB", (20, 20))
    cases = [
        (ValueError, "empty", lambda: proc(Image.new("RGB", (0, 5)))),
        (ValueError, "mode 'I;16'", lambda: proc(Image.new("I;16", (5, 5)))),
        (ValueError, "mode 'F'", lambda: proc(Image.new("F", (5, 5)))),
        (ValueError, "10000-pixel limit", lambda: proc(Image.new("RGB", (101, 100)))),
        (ValueError, "8-frame limit", lambda: proc([[ok] * 9])),
        (ValueError, "at least one frame", lambda: proc([[]])),
        (ValueError, "share one size", lambda: proc([[ok, Image.new("RGB", (20, 21))]])),
        (ValueError, "under the 4-patch minimum", lambda: ImageProcessor(max_patches_per_video=30)([[ok] * 9])),
        (ValueError, "cannot fit", lambda: ImageProcessor(max_patches=3, min_patches=1).plan(100, 100)),
        (ValueError, "must be an integer", lambda: ImageProcessor(max_patches=0)),
        (ValueError, "over the patch budget", lambda: ImageProcessor(max_patches=16, min_patches=32)),
        (TypeError, "PIL", lambda: proc([np.zeros((4, 4, 3))])),
        (TypeError, "frame 1", lambda: proc([[ok, "x"]])),
    ]
    for exc, text, call in cases:
        with pytest.raises(exc) as info:
            call()
        assert text in _one_line(info), (text, str(info.value))
    empty = proc([])
    assert empty.pixel_values.shape == (0, 3, 14, 14) and empty.grid_thws.shape == (0, 3)
