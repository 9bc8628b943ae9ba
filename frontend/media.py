"""Images and videos in programs: `image(source)` and `video(path, num_frames)`, as SGLang's
`sgl.image` / `sgl.video`. The image is read here, in the program's process (a path, bytes, a
PIL image or a data: URL), and travels to the runtime as its encoded bytes: raw in the msgpack
frame over ZeroMQ, as a base64 data: URL in /generate's `image_data` over HTTP. At its place
in the text goes the model's image placeholder (the runtime's model_info names it).

A video is `num_frames` frames sampled evenly with PyAV (`pip install av`), each sent as an
image: the runtime has no temporal video encoding, so a video costs its frames' image tokens.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

from radixflow.ir import ExprList, Image

MAX_IMAGE_BYTES = 16 << 20  # an image above this is refused here (the server has its own cap)


def image(source: Any) -> Image:
    """An image for the prompt: a file path, the file's bytes, a PIL image (saved as PNG) or
    a data: URL. Raises ValueError for anything else, a missing file or an oversized image;
    the runtime refuses an undecodable one."""
    if isinstance(source, (bytes, bytearray)):
        data = bytes(source)
    elif isinstance(source, str) and source.startswith("data:"):
        header, _, payload = source.partition(",")
        if not header.endswith(";base64"):
            raise ValueError("a data: URL image must be base64 (data:image/...;base64,...)")
        data = base64.b64decode(payload, validate=True)
    elif isinstance(source, (str, Path)):
        path = Path(source).expanduser()
        if not path.is_file():
            raise ValueError(f"no image file {str(path)!r}")
        data = path.read_bytes()
    elif hasattr(source, "save") and hasattr(source, "size"):  # a PIL image
        out = io.BytesIO()
        source.save(out, format="PNG")
        data = out.getvalue()
    else:
        raise ValueError(f"image() takes a path, bytes, a PIL image or a data: URL, not "
                         f"{type(source).__name__}")  # fmt: skip
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"an image of {len(data)} bytes exceeds {MAX_IMAGE_BYTES}")
    return Image(data)


def video(path: str | Path, num_frames: int) -> ExprList:
    """`num_frames` frames of the video at `path`, sampled evenly over its length, as that
    many images. Needs PyAV (`pip install av`); raises ValueError without it, for a missing
    or unreadable file, or num_frames < 1."""
    if type(num_frames) is not int or num_frames < 1:
        raise ValueError("num_frames must be a positive int")
    try:
        import av  # noqa: PLC0415 (optional: only programs with videos need PyAV)
    except ImportError as e:
        raise ValueError("video() needs PyAV to read frames: pip install av") from e
    try:
        with av.open(str(path)) as container:
            frames = [frame.to_image() for frame in container.decode(video=0)]
    except (OSError, av.error.FFmpegError) as e:
        raise ValueError(f"cannot read video {str(path)!r}: {e}") from e
    if not frames:
        raise ValueError(f"video {str(path)!r} has no frames")
    step = len(frames) / num_frames
    picked = [frames[min(int(i * step), len(frames) - 1)] for i in range(num_frames)]
    return ExprList(tuple(image(frame) for frame in picked))


def data_url(data: bytes) -> str:
    """An image's bytes as /generate's `image_data` string."""
    return "data:image/*;base64," + base64.b64encode(data).decode()
