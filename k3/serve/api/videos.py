"""Videos in chat requests: `video_url` content parts (vLLM's form), decoded and sampled at the
processor's `sample_fps` (k3.media.video), then one tower input per clip of
`temporal_merge_kernel_size` frames, each prompted by its start time (docs/SERVING.md "Videos").

Accepted: `data:` URIs of video/mp4, video/webm, video/quicktime, video/x-matroska (these need
PyAV, the `video` extra) and animated image/gif, image/webp, image/png; http(s) URLs only under the
server's fetch policy (k3.serve.api.media_fetch), like images. Each clip's cache key hashes its
tower input (k3.serve.api.images.media_digest), so the same video hits and another never shares pages."""
from __future__ import annotations

import base64
import math
from pathlib import Path

from k3.media.image_processor import ImageProcessor, ResizePlan
from k3.media.video import VideoError, decode_video
from k3.serve.api.images import ImageError, PreparedImages, process_one, read_media_file, url_bytes
from k3.serve.api.media_fetch import FetchPolicy

VIDEO_TYPES = {"video/mp4": "MP4", "video/webm": "WebM", "video/quicktime": "MOV", "video/x-matroska": "MKV",
               "image/gif": "GIF", "image/webp": "WebP", "image/png": "PNG (animated)", "image/apng": "PNG (animated)"}
MAX_VIDEO_BYTES = 64 << 20
# a file's media type for `k3 chat`'s /video, by its suffix (the decoder reads the bytes either way)
SUFFIX_TYPES = {".mp4": "video/mp4", ".m4v": "video/mp4", ".webm": "video/webm", ".mov": "video/quicktime",
                ".mkv": "video/x-matroska", ".gif": "image/gif", ".webp": "image/webp", ".png": "image/png",
                ".apng": "image/apng"}
# the demuxer each declared container type names (k3.media.video: PyAV never probes)
AV_FORMAT_OF = {"video/mp4": "mov", "video/quicktime": "mov", "video/webm": "matroska", "video/x-matroska": "matroska"}
DEFAULT_MAX_FRAMES = 256  # sampled frames a video (64 clips); K3's max_num_frames_each_video is not published


def prepare_video(url: str, where: str, processor: ImageProcessor, fetch_policy: FetchPolicy | None = None,
                  max_placeholders: int | None = None) -> tuple[PreparedImages, list[str]]:
    """One video part: its clips as tower inputs (one grid row each) and each clip's timestamp
    prompt; ImageError naming `where`. A video whose clips need more than `max_placeholders` image
    tokens (what the model's length leaves) is refused before its frames are kept."""
    data, media_type = url_bytes(url, where, what="video", types=VIDEO_TYPES, max_bytes=MAX_VIDEO_BYTES,
                                 fetch_policy=fetch_policy)
    max_frames = processor.max_frames if processor.max_frames is not None else DEFAULT_MAX_FRAMES
    try:
        video = decode_video(data, sample_fps=processor.sample_fps, max_frames=max_frames,
                             max_pixels=processor.max_pixels, av_format=AV_FORMAT_OF.get(media_type),
                             frame_size=lambda w, h: clip_frame_size(processor, w, h),
                             admit=lambda n, w, h: admit_video(processor, n, w, h, max_placeholders))
    except VideoError as e:
        raise ImageError(f"{where}: {e}") from None
    out, stamps = PreparedImages([], [], [], []), []
    for stamp, frames in video.clips(processor.temporal_pool):
        out.extend(process_one(frames, where, processor))
        stamps.append(stamp)
    return out, stamps


def clip_plan(processor: ImageProcessor, width: int, height: int) -> ResizePlan:
    """How the processor resizes each frame of a full clip of this size."""
    return processor.plan(width, height, processor.frame_budget(processor.temporal_pool))


def clip_frame_size(processor: ImageProcessor, width: int, height: int) -> tuple[int, int]:
    """What a decoded frame is shrunk to at once (the processor then resizes it to the same size, a copy)."""
    plan = clip_plan(processor, width, height)
    return plan.width, plan.height


def admit_video(processor: ImageProcessor, frames: int, width: int, height: int, max_placeholders: int | None) -> None:
    """VideoError when `frames` sampled frames of this size need more image tokens than fit."""
    if max_placeholders is None:
        return
    try:
        plan = clip_plan(processor, width, height)
    except ValueError as e:
        raise VideoError(str(e)) from None
    need = math.ceil(frames / processor.temporal_pool) * processor.placeholders(plan)
    if need > max_placeholders:
        raise VideoError(f"its {frames} sampled frames need {need:,} image tokens, more than the {max_placeholders:,} "
                         "the model's length leaves; send a shorter or smaller video")


def video_part_from_file(path: str | Path) -> dict:
    """A video file as the `video_url` content part a client would send (a data: URI) for
    `k3 chat`'s /video; ImageError naming the file."""
    path = Path(path).expanduser()
    media_type = SUFFIX_TYPES.get(path.suffix.lower())
    if media_type is None:
        raise ImageError(f"{path}: not a video file name; accepted: {', '.join(SUFFIX_TYPES)}")
    data = read_media_file(path, "video", MAX_VIDEO_BYTES)
    return {"type": "video_url", "video_url": {"url": f"data:{media_type};base64,{base64.b64encode(data).decode()}"}}


def clip_parts(stamps: list[str]) -> list[dict]:
    """What a video part becomes in the messages the renderer takes: per clip, its timestamp text
    and an image slot the clip's placeholders fill."""
    return [part for stamp in stamps for part in ({"type": "text", "text": stamp}, {"type": "image"})]
