"""Video decoding and the official frame sampling (k3.media.video): the sampled frame numbers and
timestamps equal the official formulas (Kimi-K2.5's `split_video_chunks` / `timestamp_as_str`,
transcribed here with numpy and datetime), animated GIFs decode with Pillow, MP4 with PyAV, and
every bad or oversized video is one VideoError line."""
from __future__ import annotations

import io
import random
from datetime import datetime, timezone

import numpy as np
import pytest
from PIL import Image

from k3.media.video import VideoError, decode_video, sample_indices, timestamp_text


def official_indices(n: int, fps: float, sample_fps: float, max_frames: int | None) -> list[int]:
    rate = min(sample_fps, fps)
    k = max(round(n * rate / fps), 1)
    if max_frames is not None:
        k = min(k, max_frames)
    return np.linspace(0, n - 1, k).round().astype(int).tolist()


def official_timestamp(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%H:%M:%S") + f".{int((t % 1) * 1000):03d}"


def test_sampling_and_timestamps_follow_the_official_formulas():
    rng = random.Random(0)
    for _ in range(500):
        n, fps = rng.randint(1, 3000), rng.choice([1.0, 5.0, 7.5, 10.0, 23.976, 25.0, 30.0, 59.94, 120.0])
        sample_fps, max_frames = rng.choice([0.5, 1.0, 2.0, 8.0, 60.0]), rng.choice([None, 1, 7, 64, 256])
        assert sample_indices(n, fps, sample_fps, max_frames) == official_indices(n, fps, sample_fps, max_frames)
    for t in [0.0, 0.5, 0.999, 1.0, 59.25, 61.125, 3599.9, 3600.0, 7322.042, rng.uniform(0, 86399)]:
        assert timestamp_text(t) == official_timestamp(t)
    assert sample_indices(10, 10.0, None) == list(range(10))  # no sample_fps: every frame


def gif_bytes(frames: int, ms: int = 100, size=(56, 84)) -> bytes:
    images = [Image.new("RGB", size, (20 * i % 256, 255 - 20 * i % 256, 60)) for i in range(frames)]
    buf = io.BytesIO()
    images[0].save(buf, format="GIF", save_all=True, append_images=images[1:], duration=ms, loop=0)
    return buf.getvalue()


def mp4_bytes(frames: int, fps: int = 10, size=(64, 48)) -> bytes:
    av = pytest.importorskip("av")
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for i in range(frames):
            frame = np.full((size[1], size[0], 3), (25 * i) % 256, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def test_an_animated_gif_is_sampled_at_sample_fps():
    video = decode_video(gif_bytes(10), sample_fps=8.0, max_pixels=10_000)
    assert video.fps == pytest.approx(10.0) and video.source_frames == 10
    assert video.indices == official_indices(10, 10.0, 8.0, None) == [0, 1, 3, 4, 5, 6, 8, 9]
    assert [f.getpixel((0, 0))[0] for f in video.frames] == [20 * i % 256 for i in video.indices]
    assert [stamp for stamp, _ in video.clips(4)] == ["00:00:00.000", "00:00:00.500"]
    assert [len(frames) for _, frames in video.clips(4)] == [4, 4]
    assert decode_video(gif_bytes(10), sample_fps=8.0, max_frames=3, max_pixels=10_000).indices == [0, 4, 9]


def test_an_mp4_decodes_with_pyav():
    video = decode_video(mp4_bytes(12), sample_fps=5.0, max_pixels=10_000)
    assert video.fps == pytest.approx(10.0) and video.source_frames == 12
    assert video.indices == official_indices(12, 10.0, 5.0, None)
    assert all(f.size == (64, 48) and f.mode == "RGB" for f in video.frames)
    grey = [f.getpixel((10, 10))[0] for f in video.frames]  # lossy, but each frame's own level
    assert all(abs(g - (25 * i) % 256) <= 12 for g, i in zip(grey, video.indices))


@pytest.mark.parametrize("av_format", [None, "mov", "matroska"])
def test_a_playlist_cannot_make_the_decoder_open_local_files(tmp_path, monkeypatch, av_format):
    """FFmpeg's concat demuxer would read the files the data names: PyAV is never left to probe."""
    pytest.importorskip("av")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "secret.mp4").write_bytes(mp4_bytes(4))
    for playlist in (b"ffconcat version 1.0\nfile secret.mp4\n", b"#EXTM3U\n#EXTINF:1,\nsecret.mp4\n#EXT-X-ENDLIST\n"):
        with pytest.raises(VideoError, match="not an MP4, MOV, MKV or WebM file"):
            decode_video(playlist, sample_fps=8.0, max_pixels=10_000, av_format=av_format)
    if av_format != "matroska":  # an MP4 still decodes, named or probed among the allowed demuxers
        assert decode_video(mp4_bytes(4), sample_fps=8.0, max_pixels=10_000, av_format=av_format).source_frames == 4


@pytest.mark.parametrize("data, kwargs, message", [
    (b"not a video at all", {}, "could not be decoded"),
    (None, {"max_pixels": 100}, "over the limit of 100"),
    (None, {"max_source_frames": 5}, "10 frames, over the limit of 5"),
    (None, {"max_seconds": 1e-9}, "decoding the video took longer than 1e-09 s"),
])
def test_bad_videos_are_one_line(data, kwargs, message):
    pytest.importorskip("av")  # bytes Pillow cannot open go to PyAV
    with pytest.raises(VideoError, match=message) as e:
        decode_video(data or gif_bytes(10), sample_fps=8.0, **{"max_pixels": 10_000, **kwargs})
    assert "\n" not in str(e.value)
