"""Images at the edge (torch-free): an image given as bytes, a data: URL, base64 or (where the
server allows it) a local path is read, capped, decoded once to check it, hashed over its
pixels and measured (its placeholder token count, from the model's image processor sizes); its
placeholder in the prompt is expanded to that many tokens.

The prompt names each image with one image token (`<|image_pad|>` for Qwen2.5-VL, inside
`<|vision_start|>...<|vision_end|>` as its chat template writes it), in the order of the
images. The scheduler's copy of the prompt carries, at an image's placeholders, the image's
key (a value past the vocabulary derived from its pixel hash, as SGLang pads them), so the
radix tree shares an image's KV only between requests with the same pixels.
Every refusal is an ImageError (a 400 at the HTTP doors, `invalid_request` on ZeroMQ).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixflow.runtime.protocol.messages import ImageItem

BASE64 = re.compile(r"[A-Za-z0-9+/=\s]*")
KEY_SPACE = 1 << 40  # keys lie in [vocab_size, vocab_size + KEY_SPACE)
TEXT_ONLY = "this model has no vision (a text-only model): images are not supported"


class ImageError(ValueError):
    """An image the request may not carry: unreadable, too large, the wrong type, or too many."""


@dataclass(frozen=True)
class ImageRules:
    """The server's limits (ServerConfig's max_image_bytes, max_request_image_bytes,
    max_image_pixels, allow_local_media) and the model's vision info (None: text only)."""

    vision: dict[str, Any] | None
    max_image_bytes: int
    max_request_bytes: int
    max_pixels: int
    allow_local: bool

    def read(self, item: Any) -> bytes:
        """The encoded file of one `image_data` entry: bytes as they are; a str as a data:
        URL, a local path (when allowed), or base64. Raises ImageError."""
        if isinstance(item, (bytes, bytearray)):
            data = bytes(item)
        elif not isinstance(item, str):
            raise ImageError(f"an image must be bytes or a string, got {type(item).__name__}")
        elif item.startswith("data:"):
            data = _data_url(item, self.max_image_bytes)
        elif item.startswith(("http://", "https://")):  # the HTTP doors fetched theirs
            raise ImageError("remote image URLs are fetched by the HTTP doors only, with the "
                             "server's --allow-remote-media; send the image's bytes")  # fmt: skip
        elif BASE64.fullmatch(item[:4096]) and len(item) >= 64:  # "/9j/..." is a JPEG's
            data = _base64(item, self.max_image_bytes)
        elif _looks_like_path(item):
            data = self._local(item)
        else:
            data = _base64(item, self.max_image_bytes)
        if len(data) > self.max_image_bytes:
            raise ImageError(f"an image of {len(data)} bytes exceeds {self.max_image_bytes}")
        return data

    def _local(self, path: str) -> bytes:
        if not self.allow_local:
            raise ImageError("local image paths are refused (the server's --allow-local-media)")
        file = Path(path.removeprefix("file://")).expanduser()
        if not file.is_file():
            raise ImageError(f"no image file {str(file)!r}")
        if file.stat().st_size > self.max_image_bytes:
            raise ImageError(f"image file {str(file)!r} exceeds {self.max_image_bytes} bytes")
        return file.read_bytes()

    def items(
        self, images: list[Any], ids: list[int], vocab_size: int
    ) -> tuple[list[int], list[int], list[ImageItem]]:
        """Expand each image's placeholder in `ids` -> (the prompt the client sees, with
        image tokens; the scheduler's prompt, with the images' keys there; the images)."""
        if self.vision is None:
            raise ImageError(TEXT_ONLY)
        datas = [self.read(image) for image in images]
        total = sum(map(len, datas))
        if total > self.max_request_bytes:
            raise ImageError(f"the request's images total {total} bytes; the limit is "
                             f"{self.max_request_bytes}")  # fmt: skip
        token = self.vision["image_token_id"]
        places = [i for i, t in enumerate(ids) if t == token]
        if len(places) != len(datas):
            raise ImageError(f"the prompt has {len(places)} image placeholder(s) for "
                             f"{len(datas)} image(s)")  # fmt: skip
        shown, keyed, out = [], [], []
        previous = 0
        for place, data in zip(places, datas):
            grid, digest = self.measure(data)
            merge = self.vision["processor"]["merge_size"]
            num_tokens = math.prod(grid) // merge**2
            shown += ids[previous:place]
            keyed += ids[previous:place]
            key = vocab_size + digest % KEY_SPACE
            out.append(ImageItem(data, key, len(shown), grid, num_tokens))
            shown += [token] * num_tokens
            keyed += [key] * num_tokens
            previous = place + 1
        shown += ids[previous:]
        keyed += ids[previous:]
        return shown, keyed, out

    def measure(self, data: bytes) -> tuple[list[int], int]:
        """-> (the (t, h, w) patch grid the image processor will give it, a hash of its
        decoded pixels). Raises ImageError for a file that is not a decodable image."""
        from PIL import Image, UnidentifiedImageError  # noqa: PLC0415 (optional: vision models only)

        try:
            with Image.open(io.BytesIO(data)) as image:
                if image.width * image.height > self.max_pixels:
                    raise ImageError(f"an image of {image.width}x{image.height} pixels exceeds "
                                     f"{self.max_pixels}")  # fmt: skip
                rgb = image.convert("RGB")
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
            if isinstance(e, ImageError):
                raise
            raise ImageError(f"not a decodable image: {e}") from e
        digest = hashlib.sha256(f"{rgb.width}x{rgb.height}:".encode() + rgb.tobytes()).digest()
        p = self.vision["processor"]
        factor = p["patch_size"] * p["merge_size"]
        try:
            height, width = smart_resize(
                rgb.height, rgb.width, factor, p["min_pixels"], p["max_pixels"]
            )
        except ValueError as e:
            raise ImageError(str(e)) from e
        grid = [1, height // p["patch_size"], width // p["patch_size"]]
        return grid, int.from_bytes(digest[:8], "little")


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """The size Qwen2-VL's image processor resizes to (transformers' `smart_resize`): both
    sides multiples of `factor`, the area within [min_pixels, max_pixels], the aspect kept."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError("an image's aspect ratio must be under 200")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _data_url(url: str, limit: int) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ImageError("a data: URL must be data:<type>;base64,<data>")
    kind = header.removeprefix("data:").removesuffix(";base64")
    if kind and not kind.startswith("image/"):
        raise ImageError(f"a data: URL of type {kind!r} is not an image")
    return _base64(payload, limit)


def _base64(text: str, limit: int) -> bytes:
    if len(text) > limit * 4 // 3 + 4:
        raise ImageError(f"an image exceeds {limit} bytes")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError("an image string must be a data: URL, base64 or a file path") from e


def _looks_like_path(text: str) -> bool:
    return text.startswith(("/", "./", "../", "~", "file://")) or (
        len(text) < 4096 and Path(text).suffix.lower() in (".png", ".jpg", ".jpeg", ".gif",
                                                             ".webp", ".bmp")
    )  # fmt: skip
