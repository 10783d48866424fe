"""Every image and video part of a chat request, in prompt order, made ready for the renderer and
the engine: each image is one tower input; each video becomes its clips, and its part in the
messages is rewritten into what the renderer places, a timestamp text part before each clip's
image slot (k3.serve.api.videos)."""
from __future__ import annotations

import copy
from dataclasses import dataclass

from k3.media.image_processor import ImageProcessor
from k3.serve.api.images import ImageError, PreparedImages, prepare_image
from k3.serve.api.media_fetch import FetchPolicy
from k3.serve.api.videos import clip_parts, prepare_video

MAX_IMAGES = 16  # image parts per request
MAX_VIDEOS = 4  # video parts per request


@dataclass
class PreparedMedia:
    images: PreparedImages  # one row per image and per video clip, in prompt order
    messages: list[dict]  # the request's messages with each video part expanded (what the renderer takes)


def media_parts(messages: list[dict]) -> list[tuple[int, int, str, str, str]]:
    """(message, part, kind, url, where) of every image_url / video_url part, in prompt order."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("image_url", "video_url"):
                value = part.get(kind)
                url = value.get("url") if isinstance(value, dict) else value
                out.append((i, j, kind, url, f"messages[{i}].content[{j}].{kind}"))
    for kind, limit in (("image_url", MAX_IMAGES), ("video_url", MAX_VIDEOS)):
        n = sum(1 for p in out if p[2] == kind)
        if n > limit:
            raise ImageError(f"messages: {n} {kind.split('_')[0]}s, at most {limit} per request")
    return out


def prepare_media(messages: list[dict], processor: ImageProcessor, fetch_policy: FetchPolicy | None = None,
                  max_placeholders: int | None = None) -> PreparedMedia:
    """Decode, check and process every image and video part; ImageError naming the part. A video
    that needs more image tokens than `max_placeholders` (the model's length) leaves after the
    parts before it is refused before its frames are kept."""
    images = PreparedImages([], [], [], [])
    expanded: dict[tuple[int, int], list[dict]] = {}
    for i, j, kind, url, where in media_parts(messages):
        if kind == "image_url":
            images.extend(prepare_image(url, where, processor, fetch_policy))
            continue
        room = None if max_placeholders is None else max(max_placeholders - sum(images.counts), 0)
        clips, stamps = prepare_video(url, where, processor, fetch_policy, room)
        images.extend(clips)
        expanded[(i, j)] = clip_parts(stamps)
    if not expanded:
        return PreparedMedia(images, messages)
    out = copy.copy(messages)
    for i in sorted({i for i, _ in expanded}):
        parts = []
        for j, part in enumerate(messages[i]["content"]):
            parts.extend(expanded.get((i, j), [part]))
        out[i] = {**messages[i], "content": parts}
    return PreparedMedia(images, out)
