"""Images in requests, for every wire format: where each one comes from, its bytes, and where it
goes in the rendered prompt.

A route records each image as an `ImageSource` (base64 with an optional media type, a `data:`
URL, or an http(s) URL) and writes `slot(i)` into the message text where the image stands.
`load_images` turns the sources into checked bytes (400s name the image and the problem);
`place_images` finds the slots in the rendered prompt, in the order the template wrote them
(a truncated chat has dropped some), and swaps each for the runner's marker.

Ollama `images`, OpenAI `image_url`, Anthropic `image` blocks and Responses `input_image` all
come down to `ImageSource(where, data=..., media_type=...)` or `ImageSource(where, url=...)`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import re
import socket
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

from aiohttp.abc import AbstractResolver
from localllm.engine.runner.protocol import IMAGE_MARKER

from .errors import ChatError

MAX_IMAGE_BYTES = 20 << 20
# Pixels an image may declare (8K UHD): decoding is width x height x 3 bytes whatever the file's
# size, so a 380 KB PNG of 20000 x 20000 cost the runner 1.15 GB. Read from the header, before
# anything decodes it.
MAX_IMAGE_PIXELS = 7680 * 4320
FETCH_TIMEOUT_S = 10.0
MAX_REDIRECTS = 3
FORMATS = "PNG, JPEG, WebP or GIF"
_SLOT = re.compile(r"<__localllm_image_(\d+)__>")


@dataclass(frozen=True)
class ImageSource:
    where: str  # how the error messages name it: "messages[1].images[0]"
    data: str | None = None  # base64, or a data: URL
    media_type: str | None = None  # the media type a wire format gave with the base64
    url: str | None = None  # http(s)


def slot(i: int) -> str:
    """The stand-in for image `i` in message text until the prompt is rendered."""
    return f"<__localllm_image_{i}__>"


def place_images(prompt: str, images: tuple[bytes, ...]) -> tuple[str, tuple[str, ...]]:
    """The prompt with each image slot swapped for the runner's marker, and the base64 images
    in the order their markers now stand."""
    if not images:
        return prompt, ()
    prompt = prompt.replace(IMAGE_MARKER, "<__media_>")  # a user's literal marker stays text
    order: list[int] = []

    def swap(match: re.Match) -> str:
        i = int(match.group(1))
        if i >= len(images):
            return match.group(0)
        order.append(i)
        return IMAGE_MARKER

    prompt = _SLOT.sub(swap, prompt)
    return prompt, tuple(base64.b64encode(images[i]).decode("ascii") for i in order)


# ---- bytes, checked ----------------------------------------------------------------------
def decode_base64(data: str, where: str) -> bytes:
    """Base64 (whitespace allowed) or a data: URL's payload."""
    if data.startswith("data:"):
        head, sep, payload = data.partition(",")
        if not sep or ";base64" not in head:
            raise ChatError(f"{where}: a data: URL must be base64 (data:image/png;base64,...)",
                            "images")
        data = payload
    try:
        raw = base64.b64decode(re.sub(r"\s+", "", data), validate=True)
    except (binascii.Error, ValueError):
        raise ChatError(f"{where} is not valid base64", "images") from None
    if len(raw) > MAX_IMAGE_BYTES:
        raise ChatError(f"{where} is larger than {MAX_IMAGE_BYTES >> 20} MiB", "images")
    return raw


def image_format(raw: bytes) -> str | None:
    """The format a file's first bytes name, among the ones mtmd decodes."""
    if raw.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if raw.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if raw.startswith((b"GIF87a", b"GIF89a")):
        return "GIF"
    if raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
        return "WebP"
    return None


_OTHER_FORMATS = ((b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"), (b"BM", "BMP"),
                  (b"%PDF", "PDF"), (b"\x00\x00\x01\x00", "ICO"), (b"<svg", "SVG"),
                  (b"<?xml", "SVG/XML"))


def check_image(raw: bytes, where: str) -> str:
    """The image's format, or a 400 saying why these bytes are not an image we can read."""
    if not raw:
        raise ChatError(f"{where} is empty", "images")
    kind = image_format(raw)
    if kind is None:
        if raw[4:8] == b"ftyp":
            other = "HEIC/AVIF"
        else:
            other = next((name for magic, name in _OTHER_FORMATS if raw.startswith(magic)), None)
        if other:
            raise ChatError(f"{where} is a {other} file, an unsupported format (send {FORMATS})",
                            "images")
        raise ChatError(f"{where} is not an image (send {FORMATS})", "images")
    if _truncated(kind, raw):
        raise ChatError(f"{where} is a truncated {kind} file (it ends before the image does)",
                        "images")
    size = image_size(kind, raw)
    if size is None:
        raise ChatError(f"{where}: its {kind} header does not say the image's size", "images")
    if size[0] * size[1] > MAX_IMAGE_PIXELS:
        raise ChatError(f"{where} is {size[0]} x {size[1]} pixels, more than the "
                        f"{MAX_IMAGE_PIXELS / 1e6:.0f} megapixels an image may have; scale it "
                        f"down", "images")
    return kind


_JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def image_size(kind: str, raw: bytes) -> tuple[int, int] | None:
    """(width, height) as the file's header declares them, None when it cannot be read."""
    if kind == "PNG" and raw[12:16] == b"IHDR":
        return int.from_bytes(raw[16:20], "big"), int.from_bytes(raw[20:24], "big")
    if kind == "GIF" and len(raw) >= 10:
        return int.from_bytes(raw[6:8], "little"), int.from_bytes(raw[8:10], "little")
    if kind == "WebP":
        chunk = raw[12:16]
        if chunk == b"VP8X" and len(raw) >= 30:
            return (int.from_bytes(raw[24:27], "little") + 1,
                    int.from_bytes(raw[27:30], "little") + 1)
        if chunk == b"VP8L" and len(raw) >= 25:
            bits = int.from_bytes(raw[21:25], "little")
            return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
        if chunk == b"VP8 " and len(raw) >= 30:
            return (int.from_bytes(raw[26:28], "little") & 0x3FFF,
                    int.from_bytes(raw[28:30], "little") & 0x3FFF)
        return None
    if kind == "JPEG":
        i = 2
        while i + 9 <= len(raw):
            if raw[i] != 0xFF:
                return None
            marker = raw[i + 1]
            if marker == 0xFF:  # fill byte
                i += 1
                continue
            if marker in _JPEG_SOF:
                return int.from_bytes(raw[i + 7:i + 9], "big"), \
                    int.from_bytes(raw[i + 5:i + 7], "big")
            if marker in (0x01, *range(0xD0, 0xD8)):  # markers without a length
                i += 2
                continue
            i += 2 + int.from_bytes(raw[i + 2:i + 4], "big")
        return None
    return None


def _truncated(kind: str, raw: bytes) -> bool:
    tail = raw[-64:].rstrip(b"\x00")
    if kind == "PNG":
        return b"IEND" not in tail
    if kind == "JPEG":
        return b"\xff\xd9" not in tail
    if kind == "GIF":
        return not tail.endswith(b";")
    if kind == "WebP":
        return int.from_bytes(raw[4:8], "little") + 8 > len(raw)
    return False


# ---- sources -> bytes ----------------------------------------------------------------------
async def load_images(sources: tuple[ImageSource, ...], fetch_urls: bool) -> tuple[bytes, ...]:
    """Every source's bytes, checked; URLs fetched concurrently when `fetch_urls`."""
    async def one(source: ImageSource) -> bytes:
        if source.url is not None:
            if not fetch_urls:
                raise ChatError(f"{source.where}: image URLs are turned off (config image_urls "
                                f"= off); send the image as a data: URL", "images")
            raw = await fetch_image(source.url, source.where)
        else:
            raw = decode_base64(source.data or "", source.where)
        check_image(raw, source.where)
        return raw

    return tuple(await asyncio.gather(*(one(s) for s in sources)))


def _internal(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Private, link-local (cloud metadata), loopback or otherwise not a public address."""
    if addr.version == 6 and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return (addr.is_private or addr.is_link_local or addr.is_reserved or addr.is_multicast
            or addr.is_unspecified or addr.is_loopback)


def _resolve(host: str) -> list[str]:
    """The host's addresses (one lookup: the fetch connects to these, never asks again)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    return list(dict.fromkeys(info[4][0].split("%")[0] for info in infos))


class _PinnedResolver(AbstractResolver):
    """aiohttp's resolver, answering only with the addresses checked for each host."""

    def __init__(self) -> None:
        self.addresses: dict[str, list[str]] = {}

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET):
        if host not in self.addresses:
            raise OSError(f"{host} was not checked")
        return [{"hostname": host, "host": ip, "port": port,
                 "family": socket.AF_INET6 if ":" in ip else socket.AF_INET,
                 "proto": 0, "flags": socket.AI_NUMERICHOST}
                for ip in self.addresses[host]]

    async def close(self) -> None:
        pass


class _Unreachable(Exception):
    """Nothing answered with an image: refused, no such host, no answer, not HTTP 200. One
    message for all, so that the fetcher cannot be used to map hosts and ports."""


async def fetch_image(url: str, where: str) -> bytes:
    """GET an image URL: at most MAX_IMAGE_BYTES within FETCH_TIMEOUT_S. The URL and each
    redirect are held to one rule: no private, link-local or metadata address, and a loopback
    one only when the first URL was loopback (the user's own machine). Each host is resolved
    once, and the connection goes to the address that was checked."""
    import aiohttp

    def fail(why: str) -> ChatError:
        return ChatError(f"{where}: could not fetch {url}: {why}", "images")

    resolver = _PinnedResolver()
    first_loopback: bool | None = None

    async def check(target: str) -> None:
        nonlocal first_loopback
        parts = urlsplit(target)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise fail("only http and https URLs (or data: URLs) are taken" if target == url
                       else f"it redirects to {target!r}")
        addresses = await asyncio.to_thread(_resolve, parts.hostname)
        if not addresses:
            raise _Unreachable
        parsed = [ipaddress.ip_address(a) for a in addresses]
        loopback = all(a.is_loopback for a in parsed)
        if first_loopback is None:
            first_loopback = loopback
        if any(_internal(a) for a in parsed) and not (loopback and first_loopback):
            raise fail(f"{parts.hostname} is a private address" if target == url
                       else f"it redirects to a private address ({parts.hostname})")
        resolver.addresses[parts.hostname] = addresses

    timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)
    current = url
    try:
        await check(url)
        connector = aiohttp.TCPConnector(resolver=resolver, use_dns_cache=False)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector,
                                         trust_env=False) as session:
            for _ in range(MAX_REDIRECTS + 1):
                async with session.get(current, allow_redirects=False) as response:
                    if response.status in (301, 302, 303, 307, 308):
                        current = urljoin(current, response.headers.get("Location", ""))
                        await check(current)
                        continue
                    if response.status != 200:
                        raise _Unreachable
                    if (response.content_length or 0) > MAX_IMAGE_BYTES:
                        raise fail(f"larger than {MAX_IMAGE_BYTES >> 20} MiB")
                    body = bytearray()
                    async for chunk in response.content.iter_chunked(1 << 16):
                        body += chunk
                        if len(body) > MAX_IMAGE_BYTES:
                            raise fail(f"larger than {MAX_IMAGE_BYTES >> 20} MiB")
                    return bytes(body)
            raise fail(f"more than {MAX_REDIRECTS} redirects")
    except (_Unreachable, TimeoutError, aiohttp.ClientError, OSError):
        raise fail("nothing answered with an image there (refused, no such host, no "
                   f"answer within {FETCH_TIMEOUT_S:.0f}s, or not HTTP 200)") from None
