"""Videos to the frames the vision tower sees (DESIGN §7): decoding, the official frame sampling at
`sample_fps`, and the clips with their timestamp prompts.

The official rule, as Kimi-K2.5's processor (`KimiK25VisionProcessor.split_video_chunks` and
`media_utils.py` in the K2.5 repository; vLLM's Kimi ports call it for every video) writes it:
- fps' = min(sample_fps, the source's average fps); n = max(round(N * fps' / fps), 1) frames, at
  most `max_frames` (`max_num_frames_each_video`) when set;
- frame indices linspace(0, N - 1, n), rounded: the whole video, evenly;
- clips of `temporal_merge_kernel_size` consecutive sampled frames, each prompted by the time of
  its first frame, index / fps, as "HH:MM:SS.mmm" (`timestamp_as_str`, mode "hh:mm:ss.fff"),
  written just before the clip's placeholders; each clip is processed as a media item of its own.
K3 ships `sample_fps` 8 (docs/VISION.md, "Image processor"); its timestamp mode is not published:
K2.5's default is taken.

Decoding: Pillow for animated GIF, WebP and PNG (a frame's time is the sum of the durations
before it); PyAV (the `video` extra: `pip install 'k3[video]'`) for MP4, WebM, MKV and MOV. Every
frame is decoded (inter-coded formats need their predecessors) but only the sampled ones are
kept, and a source over `max_source_frames` frames or `max_pixels` pixels a frame is refused
before its pixels are converted; decoding stops with an error past `max_seconds` (a long,
high-resolution file fits the byte limit and would hold a server's worker for minutes). Each kept
frame is resized right after decoding when the caller gives its target size (`frame_size`), so
256 frames of the largest allowed size are never held at once. PyAV gets its demuxer named, never
probed: a probe may pick FFmpeg's concat or HLS demuxers, which open the files or URLs the data
names (a request could read the server's disk)."""
from __future__ import annotations

import io
import time
from collections.abc import Callable
from dataclasses import dataclass

from PIL import Image

DEFAULT_FRAME_MS = 100  # a GIF frame without a duration: what browsers show
MAX_SOURCE_FRAMES = 10_000
MAX_DECODE_SECONDS = 60.0  # a long high-resolution file must not hold a server's worker for minutes
PILLOW_FORMATS = ("GIF", "WEBP", "PNG")
# FFmpeg demuxers PyAV may use: mov reads MP4, MOV and M4V; matroska reads MKV and WebM
AV_FORMATS = ("mov", "matroska")


class VideoError(ValueError):
    """A video that cannot be decoded or is over a limit (one line)."""


@dataclass
class SampledVideo:
    frames: list[Image.Image]  # the sampled frames, RGB
    indices: list[int]  # their frame numbers in the source
    fps: float  # the source's average frame rate
    source_frames: int

    def clips(self, frames_per_clip: int) -> list[tuple[str, list[Image.Image]]]:
        """(timestamp prompt, frames) per clip of `frames_per_clip` sampled frames."""
        return [(timestamp_text(self.indices[i] / self.fps), self.frames[i:i + frames_per_clip])
                for i in range(0, len(self.frames), frames_per_clip)]


def sample_indices(num_frames: int, fps: float, sample_fps: float | None, max_frames: int | None = None) -> list[int]:
    """The official choice of frames (module docstring); `sample_fps` None keeps every frame."""
    if num_frames < 1:
        raise VideoError("the video has no frames")
    if not fps > 0:
        raise VideoError(f"the video's frame rate is {fps}")
    rate = fps if sample_fps is None else min(sample_fps, fps)
    n = max(round(num_frames * rate / fps), 1)
    if max_frames is not None:
        n = min(n, max_frames)
    if n == 1:
        return [0]
    step = (num_frames - 1) / (n - 1)  # numpy's linspace: i * step, the last one exactly the end; then round
    return [round(i * step) for i in range(n - 1)] + [num_frames - 1]


def timestamp_text(seconds: float) -> str:
    """"HH:MM:SS.mmm" as the official `timestamp_as_str` writes it (milliseconds truncated)."""
    whole = int(seconds)
    return f"{whole // 3600:02d}:{whole % 3600 // 60:02d}:{whole % 60:02d}.{int((seconds % 1) * 1000):03d}"


def decode_video(data: bytes, *, sample_fps: float | None, max_frames: int | None = None, max_pixels: int,
                 max_source_frames: int = MAX_SOURCE_FRAMES, max_seconds: float = MAX_DECODE_SECONDS,
                 av_format: str | None = None,
                 frame_size: Callable[[int, int], tuple[int, int]] | None = None,
                 admit: Callable[[int, int, int], None] | None = None) -> SampledVideo:
    """Encoded video bytes -> the sampled frames; VideoError in one line for anything wrong,
    including decoding that takes longer than `max_seconds`. `av_format`: the demuxer of AV_FORMATS
    the declared media type names (None: each is tried). `frame_size(width, height)`: the size a
    kept frame is shrunk to (bicubic, as the processor resizes), never enlarged. `admit(frames,
    width, height)`: called once the sampled frame count and size are known, before any frame's
    pixels are kept; it raises VideoError to refuse the video (e.g. over the model's length)."""
    decoding = _Decoding(max_seconds, frame_size, admit)
    try:
        image = Image.open(io.BytesIO(data))
    except (OSError, ValueError, Image.DecompressionBombError):
        image = None
    if image is not None and image.format in PILLOW_FORMATS:
        return _decode_pillow(image, sample_fps, max_frames, max_pixels, max_source_frames, decoding)
    return _decode_av(data, sample_fps, max_frames, max_pixels, max_source_frames, decoding, av_format)


class _Decoding:
    """The decoding's time limit, and what happens to each frame it keeps."""

    def __init__(self, seconds: float, frame_size: Callable[[int, int], tuple[int, int]] | None = None,
                 admit: Callable[[int, int, int], None] | None = None):
        self.seconds, self.end = seconds, time.monotonic() + seconds
        self.frame_size, self._admit = frame_size, admit

    def admit(self, frames: int, width: int, height: int) -> None:
        """The caller's say on the sampled frames, before any is kept (VideoError to refuse)."""
        if self._admit is not None:
            self._admit(frames, width, height)

    def check(self) -> None:
        if time.monotonic() > self.end:
            raise VideoError(f"decoding the video took longer than {self.seconds:g} s")

    def keep(self, frame: Image.Image) -> Image.Image:
        """A decoded frame as kept: RGB, shrunk to `frame_size` when that is smaller."""
        frame = frame.convert("RGB")
        if self.frame_size is None:
            return frame
        width, height = self.frame_size(frame.width, frame.height)
        if width * height >= frame.width * frame.height:
            return frame
        return frame.resize((width, height), resample=Image.Resampling.BICUBIC)


def _check_size(width: int, height: int, max_pixels: int) -> None:
    if width < 1 or height < 1:
        raise VideoError(f"the video could not be decoded (its frames are {width}x{height})")
    if width * height > max_pixels:
        raise VideoError(f"the video's frames are {width} x {height} pixels, over the limit of {max_pixels:,}")


def _decode_pillow(image: Image.Image, sample_fps, max_frames, max_pixels, max_source_frames,
                   decoding: _Decoding) -> SampledVideo:
    _check_size(image.width, image.height, max_pixels)
    n = getattr(image, "n_frames", 1)
    if n > max_source_frames:
        raise VideoError(f"the video has {n:,} frames, over the limit of {max_source_frames:,}")
    try:
        ms = 0  # whole milliseconds, as the formats store them: no float drift in fps
        for i in range(n):
            decoding.check()
            image.seek(i)
            ms += int(image.info.get("duration") or 0) or DEFAULT_FRAME_MS
        fps = n * 1000 / ms
        indices = sample_indices(n, fps, sample_fps, max_frames)
        decoding.admit(len(indices), image.width, image.height)
        frames = []
        for i in indices:
            decoding.check()
            image.seek(i)
            frames.append(decoding.keep(image))
    except VideoError:
        raise
    except (OSError, ValueError, EOFError) as e:
        raise VideoError(f"the video could not be decoded ({type(e).__name__}: {e})") from None
    return SampledVideo(frames, indices, fps, n)


def _open_av(av, data: bytes, av_format: str | None):
    """A PyAV container over `data` with a named demuxer (module docstring)."""
    if av_format is not None and av_format not in AV_FORMATS:
        raise ValueError(f"av_format must be one of {AV_FORMATS}, got {av_format!r}")
    for name in (av_format,) if av_format else AV_FORMATS:
        try:
            return av.open(io.BytesIO(data), mode="r", format=name)
        except (av.FFmpegError, OSError, ValueError, EOFError):
            continue
    raise VideoError("the video could not be decoded (not an MP4, MOV, MKV or WebM file"
                     + (" as its media type says" if av_format else "") + ")")


def _decode_av(data: bytes, sample_fps, max_frames, max_pixels, max_source_frames, decoding: _Decoding,
               av_format: str | None = None) -> SampledVideo:
    try:
        import av
    except ImportError:
        raise VideoError("this is not an animated GIF, WebP or PNG; other video formats (MP4, WebM, ...) need "
                         "PyAV: pip install 'k3[video]'") from None
    try:
        with _open_av(av, data, av_format) as container:
            if not container.streams.video:
                raise VideoError("the file has no video stream")
            stream = container.streams.video[0]
            _check_size(stream.codec_context.width, stream.codec_context.height, max_pixels)
            # frames are counted by their packets (no decoding) so that sampling knows N first
            n = sum(1 for packet in container.demux(stream) if packet.size)
            if n > max_source_frames:
                raise VideoError(f"the video has {n:,} frames, over the limit of {max_source_frames:,}")
            rate = stream.average_rate or stream.guessed_rate
            if rate is None and stream.duration and stream.time_base:
                rate = n / float(stream.duration * stream.time_base)
            fps = float(rate) if rate else 0.0
            indices = sample_indices(n, fps, sample_fps, max_frames)
            decoding.admit(len(indices), stream.codec_context.width, stream.codec_context.height)
            wanted, frames = set(indices), {}
            container.seek(0)
            for i, frame in enumerate(container.decode(stream)):
                decoding.check()
                if i in wanted:
                    frames[i] = decoding.keep(frame.to_image())
                if i >= indices[-1]:
                    break
    except VideoError:
        raise
    except (av.FFmpegError, OSError, ValueError, EOFError) as e:
        raise VideoError(f"the video could not be decoded ({type(e).__name__}: {e})") from None
    missing = [i for i in indices if i not in frames]
    if missing:  # fewer frames decoded than packets counted: keep what exists, in order
        if not frames:
            raise VideoError("the video could not be decoded (no frame decoded)")
        indices = sorted(frames)
    return SampledVideo([frames[i] for i in indices], indices, fps, n)

