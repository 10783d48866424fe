"""Images in chat requests: OpenAI `image_url` content parts with `data:` URIs (or http(s) URLs
when the server fetches: k3.serve.api.media_fetch), decoded, checked and processed into what the
engine takes (k3.serve.engine.ImageInput). Every bad image is a 400 with a message naming what is
wrong; by default nothing is fetched from the network.

The prefix cache keys an image by a hash of what the tower receives (the media kind, the grid and
the processed patches: palette, transparency and mode already applied), not of the request text:
the same picture in another PNG encoding hits, two different pictures of the same size never
share pages, nor an image and a video clip of the same frames (k3.serve.request.MediaSpan)."""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from PIL import Image, ImageOps

from k3.media.image_processor import ImageProcessor
from k3.serve.api.media_fetch import FetchError, FetchPolicy, fetch

# data: URI media types we decode, with the format the bytes must then be
FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG"}
MAX_IMAGE_BYTES = 16 << 20  # a decoded file; the request-size gate bounds the base64 text as well


class ImageError(ValueError):
    """A bad image in a request (the server answers 400)."""


@dataclass
class DecodedImage:
    image: Image.Image


def url_bytes(url: str, where: str, *, what: str, types: dict[str, str], max_bytes: int,
              fetch_policy: FetchPolicy | None = None) -> tuple[bytes, str | None]:
    """The bytes a media part's URL holds, and the media type a data: URI declared (None for a
    fetched file: its bytes say what it is). `what` ("image", "video") words the errors; `types`
    maps the accepted data: media types to a short name."""
    if not isinstance(url, str) or not url:
        raise ImageError(f"{where}: {what}_url.url must be a non-empty string")
    inline = f"send the {what} inline as a data:{next(iter(types))};base64,... URI"
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0].lower()
        if scheme in ("http", "https") and fetch_policy is not None:
            try:
                return fetch(url, replace(fetch_policy, max_bytes=min(max_bytes, fetch_policy.max_bytes))), None
            except FetchError as e:
                raise ImageError(f"{where}: {e}") from None
        if scheme in ("http", "https", "ftp", "file"):
            why = (f"remote {what} URLs are fetched over http(s) only" if fetch_policy is not None else
                   f"remote {what} URLs are not fetched (fetching is off; `k3 serve --allowed-media-domains` "
                   "turns it on)")
        else:
            why = f"unsupported {what} URL"
        raise ImageError(f"{where}: {why}; {inline}")
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise ImageError(f"{where}: malformed data: URI (no comma before the data)")
    media_type, *params = header.split(";")
    media_type = media_type.strip().lower()
    if media_type not in types:
        raise ImageError(f"{where}: unsupported {what} type {media_type or 'none'!r}; accepted: "
                         f"{', '.join(dict.fromkeys(types.values()))}")
    if "base64" not in (p.strip().lower() for p in params):
        raise ImageError(f"{where}: the {what} data must be base64-encoded (data:{media_type};base64,...)")
    if len(payload) // 4 * 3 > max_bytes:
        raise ImageError(f"{where}: the {what} is over {max_bytes >> 20} MiB")
    try:
        return base64.b64decode(payload, validate=True), media_type
    except (binascii.Error, ValueError):
        raise ImageError(f"{where}: the {what} data is not valid base64") from None


def decode_image_url(url: str, where: str, *, max_pixels: int, fetch_policy: FetchPolicy | None = None) -> DecodedImage:
    """A `data:image/png;base64,...` (or jpeg) URI -> the decoded image; an
    http(s) URL is fetched only under `fetch_policy` (k3.serve.api.media_fetch)."""
    data, media_type = url_bytes(url, where, what="image", types=FORMATS, max_bytes=MAX_IMAGE_BYTES,
                                 fetch_policy=fetch_policy)
    return decode_image_bytes(data, where, max_pixels=max_pixels,
                              expect=None if media_type is None else FORMATS[media_type])


def decode_image_bytes(data: bytes, where: str, *, max_pixels: int, expect: str | None = None) -> DecodedImage:
    """PNG or JPEG bytes -> the decoded image, upright (its EXIF orientation applied; `expect`: the
    format a data: URI declared; a fetched file's format is read from its bytes, not from the
    server's headers)."""
    try:
        image = Image.open(io.BytesIO(data))
        fmt = image.format
        if fmt not in ("PNG", "JPEG") or (expect is not None and fmt != expect):
            raise ImageError(f"{where}: the data is {fmt or 'not an image'}, not {expect or 'PNG or JPEG'}")
        width, height = image.size
        if width * height > max_pixels:  # before decoding the pixels: a decompression bomb stops here
            raise ImageError(f"{where}: the image is {width} x {height} pixels, over the limit of {max_pixels:,}")
        image.load()
        # a camera's EXIF Orientation tag says how to show the pixels: apply it, as transformers' load_image
        # does; in place, so an image without one (nearly all) is not copied
        ImageOps.exif_transpose(image, in_place=True)
    except ImageError:
        raise
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError(f"{where}: the image could not be decoded ({type(e).__name__}: {e})") from None
    return DecodedImage(image)


def media_digest(kind: str, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> bytes:
    """BLAKE2b-128 of an image's (or a video clip's) tower input: its prefix-cache key. Hashing the
    processed patches, not the file's pixels, keys exactly what the model sees."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{kind}:{grid_thw}:{pixel_values.dtype}:".encode())
    h.update(pixel_values.detach().cpu().contiguous().numpy().tobytes())
    return h.digest()


def read_media_file(path: Path, what: str, max_bytes: int) -> bytes:
    """A local file's bytes for `k3 chat`'s /image and /video; ImageError naming the file."""
    try:
        if path.stat().st_size > max_bytes:
            raise ImageError(f"{path}: the {what} is over {max_bytes >> 20} MiB")
        return path.read_bytes()
    except OSError as e:
        raise ImageError(f"{path}: {e.strerror or e}") from None


def image_part_from_file(path: str | Path) -> dict:
    """A PNG or JPEG file as the `image_url` content part a client would send (a data: URI) for
    `k3 chat`'s /image; ImageError naming the file. Its pixels are checked by `prepare_image`."""
    path = Path(path).expanduser()
    data = read_media_file(path, "image", MAX_IMAGE_BYTES)
    try:
        fmt = Image.open(io.BytesIO(data)).format
    except (OSError, ValueError):
        fmt = None
    media_type = {"PNG": "image/png", "JPEG": "image/jpeg"}.get(fmt or "")
    if media_type is None:
        raise ImageError(f"{path}: {'a ' + fmt if fmt else 'not an image'} file; PNG and JPEG are accepted")
    return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{base64.b64encode(data).decode()}"}}


@dataclass
class PreparedImages:
    pixel_values: list  # per image: [L, 3, P, P]
    grid_thws: list[tuple[int, int, int]]
    digests: list[bytes]
    counts: list[int]  # placeholders per image

    def extend(self, other: PreparedImages) -> None:
        """Append `other`'s images after these (in prompt order)."""
        for mine, theirs in zip((self.pixel_values, self.grid_thws, self.digests, self.counts),
                                (other.pixel_values, other.grid_thws, other.digests, other.counts)):
            mine.extend(theirs)

    def truncate(self, n: int) -> None:
        """Keep the first `n` images (drop those of a message that was not sent)."""
        for column in (self.pixel_values, self.grid_thws, self.digests, self.counts):
            del column[n:]

    def media(self, placeholder_id: int) -> list[list[int]]:
        """The renderer's `media`: each image's run of placeholder ids."""
        return [[placeholder_id] * n for n in self.counts]

    def engine_inputs(self, offsets: list[int]) -> list:
        """The engine's ImageInput per image, at the rendered prompt's `media_offsets`."""
        from k3.serve.engine import ImageInput

        return [ImageInput(offset, pv, grid, digest)
                for offset, pv, grid, digest in zip(offsets, self.pixel_values, self.grid_thws, self.digests)]


def prepare_image(url: str, where: str, processor: ImageProcessor,
                  fetch_policy: FetchPolicy | None = None) -> PreparedImages:
    """One image part's URL decoded (fetched under `fetch_policy`), checked and processed;
    ImageError naming `where`."""
    decoded = decode_image_url(url, where, max_pixels=processor.max_pixels, fetch_policy=fetch_policy)
    return process_one(decoded.image, where, processor)


def process_one(item, where: str, processor: ImageProcessor) -> PreparedImages:
    """One image, or one video clip (a list of frames), through the processor as one grid row;
    ImageError naming `where`."""
    try:
        inputs = processor([item])
    except ValueError as e:
        raise ImageError(f"{where}: {e}") from None
    grid = tuple(int(x) for x in inputs.grid_thws[0])
    kind = "image" if isinstance(item, Image.Image) else "video"
    return PreparedImages([inputs.pixel_values], [grid], [media_digest(kind, inputs.pixel_values, grid)],
                          [int(inputs.num_placeholders[0])])
