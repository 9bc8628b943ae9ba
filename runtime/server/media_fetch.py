"""Remote images of the HTTP doors: the http(s) URLs among a request's `image_data` are
fetched here, asynchronously, before the request is validated (server/images.py then sees
their bytes). Only with --allow-remote-media; a ZeroMQ generate carries bytes instead."""

from __future__ import annotations

import dataclasses
from typing import Any

import aiohttp

from radixflow.runtime.protocol.messages import Generate
from radixflow.runtime.server.http_request import HttpError

REMOTE_TIMEOUT_S = 10.0


class FetchError(ValueError):
    """A remote image that could not be fetched."""


async def fetch_media(msgs: list[Generate], config: Any) -> list[Generate]:
    """The HTTP doors' generates with each http(s) `image_data` entry replaced by the file it
    names, fetched without blocking the event loop (up to --max-image-bytes, within
    REMOTE_TIMEOUT_S). Raises HttpError 400 when --allow-remote-media is off or a fetch fails."""
    urls = [x for m in msgs for x in m.image_data or () if isinstance(x, str) and _remote(x)]
    if not urls:
        return msgs
    if not config.allow_remote_media:
        raise HttpError(400, "remote image URLs are refused (the server's --allow-remote-media)",
                        "image_data")  # fmt: skip
    limit, fetched = config.max_image_bytes, {}
    timeout = aiohttp.ClientTimeout(total=REMOTE_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for url in dict.fromkeys(urls):
            try:
                async with session.get(url) as response:
                    if response.status != 200:
                        raise FetchError(f"HTTP {response.status}")
                    fetched[url] = await response.content.read(limit + 1)
            except (aiohttp.ClientError, TimeoutError, FetchError) as e:
                raise HttpError(400, f"could not fetch the image {url[:200]!r}: {e}",
                                "image_data") from e  # fmt: skip
            if len(fetched[url]) > limit:
                raise HttpError(400, f"the image at {url[:200]!r} exceeds {limit} bytes",
                                "image_data")  # fmt: skip
    return [
        dataclasses.replace(m, image_data=[fetched.get(x, x) if isinstance(x, str) else x
                                           for x in m.image_data]) if m.image_data else m
        for m in msgs
    ]  # fmt: skip


def _remote(text: str) -> bool:
    return text.startswith(("http://", "https://"))
