"""Images and videos to the vision tower's packed patches (DESIGN §7, docs/VISION.md).

`ImageProcessor` turns PIL images, and videos given as lists of PIL frames, into what
`k3.model.vision.VisionModel` takes: `pixel_values [L, 3, P, P]` (float32) and `grid_thws [N, 3]`
(frames, patch rows, patch columns per image or clip; patches in (t, h, w) raster order), plus the
number of placeholder tokens each image or clip needs (its merged rows: (h / kh) * (w / kw)).

Sources. K3's checkpoint ships its own processor (`KimiK3VisionProcessor`, remote code beside
moonshotai/Kimi-K3's `preprocessor_config.json`), read here through public ports: vLLM's Kimi-K3
multimodal processor, rtp-llm's vendored K3 image processor, mlxcel's Rust port and its tests;
Kimi-K2.5's `media_utils.py` and transformers 5.24's `kimi_k25` image/video processors share the
resize rule and the patch layout (tests/media/test_image_processor.py checks ours against the
latter). What K3 does, and we do:
- Resize ("navit"): scale = min(1, sqrt(budget / (max(1, W // P) * max(1, H // P))),
  side * P / W, side * P / H); new size = max(1, int(W * scale)) x max(1, int(H * scale)), each
  capped at side * P; never upscaled. PIL bicubic, aspect ratio kept (to integer truncation).
- Pad right and bottom with black (0) up to multiples of kh * P and kw * P, so the grid tiles the
  2 x 2 merge; the padding becomes -1 after normalization.
- Transparency: pixels with alpha are composited onto a chessboard (8 px squares, 255 and 180,
  white top-left) after the resize; everything else is converted to RGB.
- Normalize (x / 255 - mean) / std with mean = std = 0.5, channels first (in float32; the official
  mixes in float64 constants, which for 0.5 gives the same bits).
- Patchify each frame in raster order: patch (r, c) = pixels [r P:(r+1) P, c P:(c+1) P].
- Video: frames in clips of `temporal_merge_kernel_size` (4), each clip one grid row (t <= 4);
  the per-frame budget is min(in_patch_limit_each_frame, round(in_patch_limit_video / frames)).

The published `media_proc_cfg` values (`K3_MEDIA_PROC_CFG`): `in_patch_limit` 65536,
`patch_limit_on_one_side` 512, `in_patch_limit_each_frame` 16384, `temporal_merge_kernel_size` 4,
`sample_fps` 8.0, `patch_size` 14, `merge_kernel_size` 2, mean/std 0.5, the chessboard above with
`transparent_bg_fill_stage` "after_resize", `fixed_output_tokens` null. `in_patch_limit_video`
655360 is reported by one public deployment study of K3 only; `max_num_frames_each_video` is not
published for K3 (K2.5's is null). K3's released processor is image-only (it refuses other media,
and SGLang's K3 notes say so); video here follows K2.5's chunking, as vLLM's K3 port does.

Where we differ from the official processor, each switchable:
- `strict_budget` (default on): the official rule bounds the *unpadded* patch count, so padding
  can exceed the budget (1861 x 7041 gives 67,268 patches for a 65,536 budget). We then shrink to
  the largest scale whose padded grid fits. Off, the sizes are the official ones exactly.
- `pad_last_clip` (default on): a video's last clip of fewer than 4 frames is filled up by
  repeating its last frame, so every clip has t = 4; the official K2.5 chunking (and transformers'
  port) leaves it short (t = frames mod 4). Off, clips are as the official.
- `min_patches` (default kh * kw, which the padding always meets, so off in effect): a larger
  minimum upscales small images, which the official rule never does.
- Hard limits, one-line `ValueError`s: images over `max_pixels` (default (side * P)^2, the largest
  square the side limit describes), videos whose per-frame budget would fall under `min_patches`
  or (when set) longer than `max_frames`, zero-size images, empty videos, frames of differing
  sizes, modes outside `READABLE_MODES` (16/32-bit, float, LAB, HSV); non-PIL input: `TypeError`.
Frame sampling (the official `sample_fps`) is k3.media.video's: a video here is the frames to encode.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

# moonshotai/Kimi-K3 preprocessor_config.json `media_proc_cfg`, as public ports and notes quote it.
K3_CHESSBOARD: dict = {
    "pattern": "chessboard",
    "chessboard_square_size": 8,
    "chessboard_square_on_top_left": True,
    "chessboard_white_value": 255,
    "chessboard_gray_value": 180,
}
K3_MEDIA_PROC_CFG: dict = {
    "in_patch_limit": 65536,
    "patch_size": 14,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "merge_kernel_size": 2,
    "fixed_output_tokens": None,
    "patch_limit_on_one_side": 512,
    "in_patch_limit_each_frame": 16384,
    "in_patch_limit_video": 655360,
    "sample_fps": 8.0,
    "temporal_merge_kernel_size": 4,
    "transparent_bg_config": K3_CHESSBOARD,
    "transparent_bg_fill_stage": "after_resize",
}

# PIL modes read as 8-bit colour; "I", "F", "I;16*" (wider than 8 bits), "La", "HSV", "LAB" are refused.
READABLE_MODES = ("1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr")
FILL_STAGES = ("before_resize", "after_resize")


@dataclass(frozen=True)
class ResizePlan:
    """Where one image (or every frame of one clip) goes: resized to `width` x `height`, then
    padded right/bottom with black to `grid_w` x `grid_h` patches of `patch_size`."""
    width: int
    height: int
    grid_h: int
    grid_w: int
    patch_size: int

    @property
    def padded_size(self) -> tuple[int, int]:
        return self.grid_w * self.patch_size, self.grid_h * self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid_h * self.grid_w


@dataclass
class VisionInputs:
    """The tower's inputs for a list of media, in order: row i of `grid_thws` is one image or one
    video clip, `num_placeholders[i]` its placeholder tokens, `media_index[i]` which input it is."""
    pixel_values: torch.Tensor
    grid_thws: torch.Tensor
    num_placeholders: list[int] = field(default_factory=list)
    media_index: list[int] = field(default_factory=list)

    def placeholders_per_media(self) -> list[int]:
        """Placeholder tokens per input item (a video's clips summed)."""
        out = [0] * (max(self.media_index) + 1 if self.media_index else 0)
        for i, n in zip(self.media_index, self.num_placeholders):
            out[i] += n
        return out


def chessboard(height: int, width: int, cfg: dict) -> np.ndarray:
    """[height, width, 3] uint8 background for transparent pixels (`transparent_bg_config` keys)."""
    square = cfg["chessboard_square_size"]
    parity = (np.arange(height)[:, None] // square + np.arange(width)[None, :] // square) % 2
    gray_here = parity == (1 if cfg["chessboard_square_on_top_left"] else 0)
    out = np.full((height, width, 3), cfg["chessboard_white_value"], dtype=np.uint8)
    out[gray_here] = cfg["chessboard_gray_value"]
    return out


def to_rgb(image: Image.Image, background: dict | None) -> Image.Image:
    """RGB image; with a `background`, pixels with alpha (an "A" band, or palette / colour-key
    transparency) are blended onto it as the official does: alpha * rgb + (1 - alpha) * board in
    float32, truncated to uint8. Without one, alpha is dropped."""
    if image.mode == "RGB" and "transparency" not in image.info:  # an RGB colour key is transparency too
        return image
    if background is None or ("A" not in image.getbands() and "transparency" not in image.info):
        return image.convert("RGB")
    rgba = np.asarray(image.convert("RGBA"))
    alpha = rgba[:, :, 3:4].astype(np.float32) / 255.0
    mixed = alpha * rgba[:, :, :3] + (1.0 - alpha) * chessboard(rgba.shape[0], rgba.shape[1], background)
    return Image.fromarray(mixed.astype(np.uint8))


def _positive_int(name: str, v) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"ImageProcessor {name} must be an integer >= 1, got {v!r}")


class ImageProcessor:
    """PIL images / videos (lists of PIL frames) -> `VisionInputs`. Defaults are K3's published
    settings (module docstring); `from_media_proc_cfg` reads a `preprocessor_config.json`,
    `from_vision_config` takes a (tiny) tower's patch size, merge kernel and frames per clip."""

    def __init__(self, *, patch_size: int = 14, merge_kernel_size: Sequence[int] | int = (2, 2),
                 image_mean: Sequence[float] = (0.5, 0.5, 0.5), image_std: Sequence[float] = (0.5, 0.5, 0.5),
                 max_patches: int = 65536, max_patches_per_side: int = 512, max_patches_per_frame: int = 16384,
                 max_patches_per_video: int | None = 655360, min_patches: int | None = None,
                 temporal_pool: int = 4, max_frames: int | None = None, max_pixels: int | None = None,
                 transparent_background: dict | None = K3_CHESSBOARD, fill_stage: str = "after_resize",
                 strict_budget: bool = True, pad_last_clip: bool = True, sample_fps: float | None = 8.0):
        kernel = (merge_kernel_size,) * 2 if isinstance(merge_kernel_size, int) else tuple(merge_kernel_size)
        if len(kernel) != 2:
            raise ValueError(f"ImageProcessor merge_kernel_size must be two integers, got {merge_kernel_size!r}")
        for name, v in (("patch_size", patch_size), ("merge_kernel_size", kernel[0]), ("merge_kernel_size", kernel[1]),
                        ("max_patches", max_patches), ("max_patches_per_side", max_patches_per_side),
                        ("max_patches_per_frame", max_patches_per_frame), ("temporal_pool", temporal_pool)):
            _positive_int(name, v)
        for name, v in (("max_patches_per_video", max_patches_per_video), ("min_patches", min_patches),
                        ("max_frames", max_frames), ("max_pixels", max_pixels)):
            if v is not None:
                _positive_int(name, v)
        if len(image_mean) != 3 or len(image_std) != 3 or min(image_std) <= 0:
            raise ValueError("ImageProcessor image_mean and image_std must be 3 values each, std > 0")
        if fill_stage not in FILL_STAGES:
            raise ValueError(f"ImageProcessor fill_stage must be one of {FILL_STAGES}, got {fill_stage!r}")
        self.patch_size = patch_size
        self.merge_kernel_size = kernel
        self.image_mean = tuple(float(m) for m in image_mean)
        self.image_std = tuple(float(s) for s in image_std)
        self.max_patches = max_patches
        self.max_patches_per_side = max_patches_per_side
        self.max_patches_per_frame = max_patches_per_frame
        self.max_patches_per_video = max_patches_per_video
        # the padding already guarantees one merge window, so this default never upscales
        self.min_patches = kernel[0] * kernel[1] if min_patches is None else min_patches
        if self.min_patches > min(max_patches, max_patches_per_frame):
            raise ValueError(f"ImageProcessor min_patches {self.min_patches} is over the patch budget")
        self.temporal_pool = temporal_pool
        self.max_frames = max_frames
        self.max_pixels = (max_patches_per_side * patch_size) ** 2 if max_pixels is None else max_pixels
        self.transparent_background = None if transparent_background is None else dict(transparent_background)
        self.fill_stage = fill_stage
        self.strict_budget = strict_budget
        self.pad_last_clip = pad_last_clip
        self.sample_fps = sample_fps  # read by k3.media.video, which samples a video's frames

    @classmethod
    def from_media_proc_cfg(cls, cfg: dict, **overrides) -> ImageProcessor:
        """From an official `preprocessor_config.json` (or its `media_proc_cfg`); absent keys take
        K3's published values; `overrides` are constructor arguments."""
        cfg = {**K3_MEDIA_PROC_CFG, **cfg.get("media_proc_cfg", cfg)}
        if cfg.get("fixed_output_tokens") is not None:
            raise ValueError("fixed_output_tokens is not supported: placeholder counts follow the image size")
        args = {
            "patch_size": cfg["patch_size"], "merge_kernel_size": cfg["merge_kernel_size"],
            "image_mean": cfg["image_mean"], "image_std": cfg["image_std"], "max_patches": cfg["in_patch_limit"],
            "max_patches_per_side": cfg["patch_limit_on_one_side"],
            "max_patches_per_frame": cfg.get("in_patch_limit_each_frame") or cfg["in_patch_limit"],
            "max_patches_per_video": cfg.get("in_patch_limit_video"),
            "temporal_pool": cfg["temporal_merge_kernel_size"], "max_frames": cfg.get("max_num_frames_each_video"),
            "transparent_background": cfg.get("transparent_bg_config"),
            "fill_stage": cfg.get("transparent_bg_fill_stage") or "after_resize", "sample_fps": cfg.get("sample_fps")}
        return cls(**{**args, **overrides})

    @classmethod
    def from_vision_config(cls, vision_config, **overrides) -> ImageProcessor:
        args = {"patch_size": vision_config.patch_size, "merge_kernel_size": tuple(vision_config.merge_kernel_size),
                "temporal_pool": vision_config.init_pos_emb_time}
        return cls(**{**args, **overrides})

    # ------------------------------------------------------------------ sizes
    def official_scale(self, width: int, height: int, budget: int) -> float:
        """The official navit scale: within the patch budget (counted on the unpadded image) and
        the side limit, never above 1."""
        p, side = self.patch_size, self.max_patches_per_side * self.patch_size
        patches = max(1, width // p) * max(1, height // p)
        return min(1.0, math.sqrt(budget / patches), side / width, side / height)

    def _plan(self, new_w: int, new_h: int) -> ResizePlan:
        p, (kh, kw) = self.patch_size, self.merge_kernel_size
        side = self.max_patches_per_side * p
        new_w, new_h = min(max(1, new_w), side), min(max(1, new_h), side)
        return ResizePlan(new_w, new_h, -(-new_h // (kh * p)) * kh, -(-new_w // (kw * p)) * kw, p)

    def plan(self, width: int, height: int, budget: int | None = None) -> ResizePlan:
        """Resize and padding of a `width` x `height` image for a `budget`-patch limit (default
        `max_patches`): the official size, then (off by default) up to `min_patches`, then (with
        `strict_budget`) down until the padded grid fits. The padded grid tiles the merge kernel."""
        budget = self.max_patches if budget is None else budget
        if width < 1 or height < 1:
            raise ValueError(f"image size {width}x{height} is empty")
        scale = self.official_scale(width, height, budget)
        plan = self._plan(int(width * scale), int(height * scale))
        if plan.num_patches < self.min_patches:
            p, side = self.patch_size, self.max_patches_per_side * self.patch_size
            scale = min(math.sqrt(self.min_patches * p * p / (width * height)), side / width, side / height)
            plan = self._plan(math.ceil(width * scale), math.ceil(height * scale))
        if self.strict_budget and plan.num_patches > budget:
            plan = self._shrink_to_fit(width, height, budget, scale)
        return plan

    def _shrink_to_fit(self, width: int, height: int, budget: int, scale: float) -> ResizePlan:
        """The largest scale <= `scale` whose padded grid holds at most `budget` patches: for each
        count of merge-window rows, the widest image that still fits; the best of those."""
        p, (kh, kw) = self.patch_size, self.merge_kernel_size
        windows = budget // (kh * kw)
        best = 0.0
        for rows in range(1, min(windows, self.max_patches_per_side // kh) + 1):
            best = max(best, min(scale, rows * kh * p / height, windows // rows * kw * p / width))
        plan = self._plan(int(width * best), int(height * best))
        if best == 0.0 or plan.num_patches > budget:
            raise ValueError(f"a {width}x{height} image cannot fit a {budget}-patch budget")
        return plan

    def placeholders(self, plan: ResizePlan) -> int:
        """Merged tokens the tower's sd2_tpool merge gives for one image or clip of this plan."""
        kh, kw = self.merge_kernel_size
        return (plan.grid_h // kh) * (plan.grid_w // kw)

    def frame_budget(self, frames: int) -> int:
        """Per-frame patch budget of a `frames`-frame video (the official video resize)."""
        budget = self.max_patches_per_frame
        if self.max_patches_per_video is not None:
            budget = min(budget, round(self.max_patches_per_video / frames))
        return budget

    def placeholder_counts(self, item) -> list[int]:
        """Placeholder tokens per grid row (one for an image, one per clip for a video) from the
        sizes alone, without touching pixels: what a prompt needs before the tower runs."""
        if isinstance(item, Image.Image):
            self._check_image(item, "image")
            return [self.placeholders(self.plan(item.width, item.height))]
        plan = self._video_plan(item)
        return [self.placeholders(plan)] * math.ceil(len(item) / self.temporal_pool)

    # ------------------------------------------------------------------ checks
    def _check_image(self, image, what: str) -> None:
        if not isinstance(image, Image.Image):
            raise TypeError(f"{what} must be a PIL.Image.Image, got {type(image).__name__}")
        if image.width < 1 or image.height < 1:
            raise ValueError(f"{what} is empty ({image.width}x{image.height})")
        if image.mode not in READABLE_MODES:
            raise ValueError(f"{what} has mode {image.mode!r}; convert it to one of {', '.join(READABLE_MODES)}")
        if image.width * image.height > self.max_pixels:
            raise ValueError(f"{what} is {image.width}x{image.height}, over the {self.max_pixels}-pixel limit")

    def _video_plan(self, frames) -> ResizePlan:
        if isinstance(frames, (str, bytes)) or not isinstance(frames, Sequence):
            raise TypeError(f"a video must be a list of PIL frames, got {type(frames).__name__}")
        if len(frames) == 0:
            raise ValueError("a video must have at least one frame")
        n = len(frames)
        if self.max_frames is not None and n > self.max_frames:
            raise ValueError(f"a video of {n} frames is over the {self.max_frames}-frame limit")
        for i, frame in enumerate(frames):
            self._check_image(frame, f"video frame {i}")
            if frame.size != frames[0].size:
                raise ValueError(f"video frame {i} is {frame.width}x{frame.height} but frame 0 is "
                                 f"{frames[0].width}x{frames[0].height}; a video's frames must share one size")
        budget = self.frame_budget(n)
        if budget < self.min_patches:
            raise ValueError(f"a video of {n} frames leaves {budget} patches a frame, under the "
                             f"{self.min_patches}-patch minimum (max_patches_per_video {self.max_patches_per_video})")
        return self.plan(frames[0].width, frames[0].height, budget)

    # ------------------------------------------------------------------ pixels
    def _pixels(self, image: Image.Image, plan: ResizePlan) -> np.ndarray:
        """[padded_h, padded_w, 3] uint8: resized (bicubic), made RGB, padded with black."""
        background = self.transparent_background
        if self.fill_stage == "before_resize":
            image = to_rgb(image, background)
        if image.size != (plan.width, plan.height):  # PIL's same-size resize is a plain copy
            image = image.resize((plan.width, plan.height), resample=Image.Resampling.BICUBIC)
        pad_w, pad_h = plan.padded_size
        out = np.zeros((pad_h, pad_w, 3), dtype=np.uint8)
        out[:plan.height, :plan.width] = np.asarray(to_rgb(image, background))
        return out

    def _patchify(self, frames: np.ndarray) -> torch.Tensor:
        """[T, H, W, 3] uint8 -> [T * (H/P) * (W/P), 3, P, P] float32, normalized, (t, h, w) order."""
        x = torch.from_numpy(frames).float() / 255.0
        x = (x - torch.tensor(self.image_mean)) * (1.0 / torch.tensor(self.image_std))
        t, h, w, c = x.shape
        p = self.patch_size
        x = x.reshape(t, h // p, p, w // p, p, c).permute(0, 1, 3, 5, 2, 4)
        return x.reshape(-1, c, p, p)

    def preprocess_image(self, image: Image.Image) -> tuple[torch.Tensor, list[int], int]:
        """One image -> (patches [L, 3, P, P], its grid row [1, h, w], its placeholder count)."""
        self._check_image(image, "image")
        plan = self.plan(image.width, image.height)
        return self._patchify(self._pixels(image, plan)[None]), [1, plan.grid_h, plan.grid_w], self.placeholders(plan)

    def preprocess_video(self, frames: Sequence[Image.Image]) -> list[tuple[torch.Tensor, list[int], int]]:
        """One video (its frames, already sampled) -> per clip of <= `temporal_pool` frames, what
        `preprocess_image` gives per image. All frames share one size, hence one plan."""
        plan = self._video_plan(frames)
        pixels = [self._pixels(f, plan) for f in frames]
        clips = []
        for start in range(0, len(pixels), self.temporal_pool):
            clip = pixels[start:start + self.temporal_pool]
            if self.pad_last_clip:  # every clip gets temporal_pool frames: repeat the last one
                clip = clip + [clip[-1]] * (self.temporal_pool - len(clip))
            clips.append((self._patchify(np.stack(clip)), [len(clip), plan.grid_h, plan.grid_w],
                          self.placeholders(plan)))
        return clips

    def __call__(self, media) -> VisionInputs:
        """A list of media, each a PIL image or a video (a list or tuple of PIL frames), packed in
        order; a single image is taken as a list of one."""
        if isinstance(media, Image.Image):
            media = [media]
        parts, grids, counts, index = [], [], [], []
        for i, item in enumerate(media):
            if isinstance(item, Image.Image):
                rows = [self.preprocess_image(item)]
            elif isinstance(item, (list, tuple)):
                rows = self.preprocess_video(item)
            else:
                raise TypeError(f"media item {i} must be a PIL image or a list of PIL frames, got {type(item).__name__}")
            for patches, grid, count in rows:
                parts.append(patches)
                grids.append(grid)
                counts.append(count)
                index.append(i)
        p = self.patch_size
        pixel_values = torch.cat(parts) if parts else torch.empty(0, 3, p, p)
        return VisionInputs(pixel_values, torch.tensor(grids, dtype=torch.long).reshape(-1, 3), counts, index)
