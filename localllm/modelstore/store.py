"""The content-addressed model store: blobs named by sha256 plus manifests naming `name:tag`.

Layout under the store root (`paths.models_dir()`):
    blobs/sha256-<hex>                  the files, immutable once published
    manifests/<name parts...>/<tag>     JSON: the model's layers (model file, companions)
    tmp/                                staging for imports and downloads (same filesystem)
    locks/                              a lock per name, and the blob collection's (manifest_io)

Publishing is ordered so a crash never leaves a listed model without its file: a blob is
written to tmp/, verified, renamed into blobs/; the manifest is written last, atomically.

The store is its owner's alone: folders 0700, blobs and manifests 0600. An import hard-links
its source only when that file is already 0600 and ours (one inode, one mode: linking a wider
file would leave it readable through its old name, and chmodding it would change the user's
file); anything else is copied.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import errno
import shutil
import stat
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from localllm.paths import private_dir

from localllm.errors import UserError
from localllm.units import human_size
from .entries import (  # the store's values, named here as before
    _CHUNK,
    _LEGACY_LAYERS,
    COMPANION_LAYERS as COMPANION_LAYERS,
    DRAFT_LAYER as DRAFT_LAYER,
    MODEL_LAYER,
    MTP_LAYER as MTP_LAYER,
    PROJECTOR_LAYER,
    Layer,
    ModelEntry,
    RemoteModel,
    model_details,
    sha256_file,
)
from .gguf_header import GGUFError, read_header
from .manifest_io import (
    References,
    collection_lock,
    name_lock,
    read_manifest_doc,
    referenced_digests,
    write_atomically,
)
from .names import ModelName, parse_name
from .shape import shape_from_header



class StoreError(UserError):
    """A store operation failed for a reason the user can act on (message says what to do)."""


class ModelNotFound(StoreError):
    status = 404


class DiskFull(StoreError):
    """The store's filesystem ran out of room (507): nothing half-written was kept."""

    status = 507


class DamagedModel(StoreError):
    """A stored model's file no longer reads as the GGUF it was (409: fetch it again)."""

    status = 409

    def __init__(self, name: object, reason: str):
        super().__init__(f"the stored file of model '{name}' is damaged ({reason}); pull or "
                         f"import it again (`localllm pull {name}`, or `localllm import FILE "
                         f"{name}`)")


class ManifestDamaged(StoreError):
    """A manifest that does not read as one (409): listed apart, its blobs kept, `rm` removes
    it."""

    status = 409

    def __init__(self, name: object, reason: str):
        self.name, self.reason = name, reason
        super().__init__(f"manifest for {name} is damaged ({reason}); remove it with "
                         f"`localllm rm {name}` and import or pull it again")


@dataclass(frozen=True)
class Damaged:
    """A stored model whose manifest is damaged, and the blobs its bytes may still name (None:
    unreadable, so every blob is kept)."""

    name: ModelName
    reason: str
    digests: frozenset[str] | None


NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def disk_full(error: OSError, what: str) -> DiskFull:
    return DiskFull(f"the disk holding the model store is full ({error.strerror}) while "
                    f"{what}; free some space (`localllm rm` unused models) and try again")


@contextlib.contextmanager
def no_room_is_disk_full(what: str):
    """An OSError meaning "no room" (full disk, quota, file size limit) as DiskFull."""
    try:
        yield
    except OSError as e:
        if e.errno in NO_ROOM:
            raise disk_full(e, what) from None
        raise


def linkable(source: Path) -> bool:
    """Whether an import may hard-link `source`: a regular file, ours, 0600 already."""
    info = source.stat()
    return (stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid()
            and stat.S_IMODE(info.st_mode) == 0o600)


def check_room_to_copy(source: Path, size: int, into: Path, link: bool) -> None:
    """DiskFull before a copy that cannot fit, rather than after writing tens of GiB of it.
    Where the source is on the store's filesystem, a link would take no room: say how."""
    free = shutil.disk_usage(into).free
    if free >= size:
        return
    hint = "free some space (`localllm rm` unused models) and try again"
    if link and source.stat().st_dev == into.stat().st_dev:
        hint += (f", or `chmod 600 {source}` so that import can hard-link it (a file that "
                 "others may read is copied, never linked)")
    raise DiskFull(f"importing {source} copies {human_size(size)} into the model store, whose "
                   f"disk has {human_size(free)} free; {hint}")


class ModelStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.blobs = self.root / "blobs"
        self.manifests = self.root / "manifests"
        self.tmp = self.root / "tmp"
        self.locks = self.root / "locks"  # flock files (manifest_io.py); never deleted

    def ensure_dirs(self) -> None:
        for d in (self.root, self.blobs, self.manifests, self.tmp):
            private_dir(d)

    # ---- blobs -------------------------------------------------------------------------
    def blob_path(self, digest: str) -> Path:
        algo, _, hexdigest = digest.partition(":")
        if algo != "sha256" or len(hexdigest) != 64 or not all(
            c in "0123456789abcdef" for c in hexdigest
        ):
            raise StoreError(f"invalid blob digest {digest!r}")
        return self.blobs / f"sha256-{hexdigest}"

    def has_blob(self, digest: str) -> bool:
        return self.blob_path(digest).is_file()

    def staging_file(self, prefix: str = "import-") -> Path:
        self.ensure_dirs()
        fd, name = tempfile.mkstemp(prefix=prefix, dir=self.tmp)
        os.close(fd)
        return Path(name)

    def publish_blob(self, staged: Path, hexdigest: str) -> str:
        """Move a verified staged file into blobs/ (a no-op when the blob is already there)."""
        digest = f"sha256:{hexdigest}"
        target = self.blob_path(digest)
        if target.exists():
            staged.unlink(missing_ok=True)
        else:
            # the mode set on the file itself, never through a link: a staged symlink is refused
            fd = os.open(staged, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.fchmod(fd, 0o600)
            finally:
                os.close(fd)
            os.replace(staged, target)
        return digest

    def add_blob(self, source: Path, link: bool = True) -> tuple[str, int]:
        """Hash `source` and store it, hard-linked when possible, else copied.
        Returns (digest, size)."""
        self.ensure_dirs()
        hexdigest = sha256_file(source)
        digest = f"sha256:{hexdigest}"
        size = source.stat().st_size
        if self.has_blob(digest):
            return digest, size
        staged = self.staging_file()  # mkstemp: 0600 from the start
        try:
            linked = False
            if link and linkable(source):
                staged.unlink()
                try:
                    os.link(source, staged)
                    linked = True
                except OSError:
                    pass
            if not linked:
                check_room_to_copy(source, size, staged.parent, link)
                with source.open("rb") as src, staged.open("wb") as dst:
                    shutil.copyfileobj(src, dst, _CHUNK)
            if staged.stat().st_size != size:
                raise StoreError(f"{source} changed while it was being imported; try again")
        except OSError as e:
            staged.unlink(missing_ok=True)
            if e.errno in NO_ROOM:
                raise disk_full(e, f"importing {source}") from None
            raise
        except BaseException:
            staged.unlink(missing_ok=True)
            raise
        return self.publish_blob(staged, hexdigest), size

    # ---- manifests ---------------------------------------------------------------------
    def _manifest_path(self, name: ModelName) -> Path:
        path = self.manifests.joinpath(*name.parts, name.tag)
        # parse_name already refuses '..' and '/', this is the belt to its braces.
        if not path.resolve().is_relative_to(self.manifests.resolve()):
            raise StoreError(f"invalid model name {name}")
        return path

    def write_manifest(self, name: ModelName, layers: list[Layer], details: dict,
                       source: str) -> ModelEntry:
        self.ensure_dirs()
        doc = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.localllm.manifest.v1+json",
            "layers": [
                {"mediaType": layer.media_type, "digest": layer.digest, "size": layer.size}
                for layer in layers
            ],
            "details": details,
            "source": source,
            "created_at": dt.datetime.now(dt.UTC).isoformat(),
        }
        path = self._manifest_path(name)
        self._write_manifest_file(name, path, doc, layers)
        return self._entry(name, path)

    def _write_manifest_file(self, name: ModelName, path: Path, doc: dict,
                             layers: list[Layer] = ()) -> None:
        """Atomically, 0600, under the name's lock (manifest_io.py); a full disk leaves neither
        the new manifest nor a temporary file. Its blobs are checked under the collection lock,
        so that no removal deletes one between the check and the rename."""
        with name_lock(self.locks, name.tagged), collection_lock(self.locks, alone=False):
            for layer in layers:
                if not self.has_blob(layer.digest):
                    raise StoreError(f"blob {layer.digest} is missing; cannot write {name}")
            for directory in reversed(path.parent.relative_to(self.manifests).parents):
                private_dir(self.manifests / directory)
            private_dir(path.parent)
            try:
                write_atomically(path, doc)
            except OSError as e:
                if e.errno in NO_ROOM:
                    raise disk_full(e, f"writing the manifest of {name}") from None
                raise

    def _entry(self, name: ModelName, path: Path) -> ModelEntry:
        """The manifest at `path` as an entry; ManifestDamaged for anything that is not one
        (every field's type checked here, so that no route meets a surprise later)."""
        try:
            doc = read_manifest_doc(path)
            details, source = doc.get("details", {}), doc.get("source", "")
            if not isinstance(details, dict) or not isinstance(source, str):
                raise TypeError("its details must be an object and its source text")
            modified = dt.datetime.fromtimestamp(path.stat().st_mtime, dt.UTC).isoformat()
            if "remote" in doc:
                remote = RemoteModel(**doc["remote"])
                if not all(isinstance(v, str) for v in vars(remote).values()):
                    raise TypeError("its remote's url, model and key variable must be text")
                return ModelEntry(name=name, layers=(), details=details, source=source,
                                  modified_at=modified, model_path=None, remote=remote)
            layers = tuple(
                Layer(_LEGACY_LAYERS.get(d["mediaType"], d["mediaType"]), d["digest"],
                      int(d["size"])) for d in doc["layers"]
            )
            for layer in layers:
                self.blob_path(layer.digest)  # a digest that names no blob is damage too
            model_layer = next(x for x in layers if x.media_type == MODEL_LAYER)
        except (OSError, ValueError, KeyError, TypeError, StopIteration, RecursionError,
                StoreError) as e:
            raise ManifestDamaged(name, str(e)[:200] or type(e).__name__) from None
        return ModelEntry(name=name, layers=layers, details=details, source=source,
                          modified_at=modified, model_path=self.blob_path(model_layer.digest))

    def add_remote(self, name: str | ModelName, remote: RemoteModel) -> ModelEntry:
        """Name a model that lives on an OpenAI-compatible server (replacing any entry of
        that name); `rm` removes only this entry."""
        model = parse_name(name) if isinstance(name, str) else name
        self.ensure_dirs()
        doc = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.localllm.manifest.v1+json",
            "layers": [],
            "remote": asdict(remote),
            "details": {"format": "remote", "family": "remote", "families": ["remote"],
                        "parameter_size": "", "quantization_level": ""},
            "source": f"remote:{remote.shown_url}",
            "created_at": dt.datetime.now(dt.UTC).isoformat(),
        }
        path = self._manifest_path(model)
        self._write_manifest_file(model, path, doc)
        return self._entry(model, path)

    def manifest_file(self, name: str | ModelName) -> Path:
        """Where the manifest of `name` is (whether or not there is one): what a cache of
        entries stats to see the model changed (BadModelName for a name that is not one)."""
        return self._manifest_path(parse_name(name) if isinstance(name, str) else name)

    def get(self, name: str | ModelName) -> ModelEntry:
        model = parse_name(name) if isinstance(name, str) else name
        path = self._manifest_path(model)
        if not path.is_file():
            raise ModelNotFound(f"model '{model}' not found; see `localllm list`, or "
                                f"`localllm pull {model.base}`")
        return self._entry(model, path)

    def exists(self, name: str | ModelName) -> bool:
        model = parse_name(name) if isinstance(name, str) else name
        return self._manifest_path(model).is_file()

    def list(self) -> list[ModelEntry]:
        return self.scan()[0]

    def scan(self) -> tuple[list[ModelEntry], list[Damaged]]:
        """Every stored model, and apart those whose manifest is damaged: one bad manifest
        hides no other model and stops nothing."""
        entries: list[ModelEntry] = []
        damaged: list[Damaged] = []
        for name, path in self._manifest_files():
            try:
                entries.append(self._entry(name, path))
            except StoreError as e:
                damaged.append(Damaged(name, getattr(e, "reason", str(e)),
                                       referenced_digests(path)))
        return entries, damaged

    def _manifest_files(self) -> list[tuple[ModelName, Path]]:
        found = []
        # os.walk skips a folder it cannot read (onerror=None) instead of raising
        for folder, dirs, files in os.walk(self.manifests):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for file in sorted(files):
                path = Path(folder, file)
                if file.startswith(".") or not _is_file(path):
                    continue
                rel = path.relative_to(self.manifests).parts
                found.append((ModelName(rel[:-1], rel[-1]), path))
        return found

    def copy(self, source: str, destination: str) -> ModelEntry:
        entry = self.get(source)
        dest = parse_name(destination)
        if entry.remote is not None:
            return self.add_remote(dest, entry.remote)
        return self.write_manifest(dest, list(entry.layers), entry.details,
                                   f"copy:{entry.name}")

    def remove(self, name: str | ModelName) -> ModelEntry | None:
        """Remove the manifest and those of its blobs that no other manifest, damaged or not,
        may name. Other blobs stay: an upload waiting for its create, a pull between publishing
        its blob and writing its manifest (unreferenced blobs are swept at startup, past an
        age). A damaged manifest is removed too (None returned): the blobs its bytes name go
        as a whole one's would."""
        model = parse_name(name) if isinstance(name, str) else name
        path = self._manifest_path(model)
        with name_lock(self.locks, model.tagged), collection_lock(self.locks, alone=True):
            entry: ModelEntry | None = None
            try:
                entry = self.get(model)
                digests = frozenset(layer.digest for layer in entry.layers)
            except ManifestDamaged:
                digests = referenced_digests(path) or frozenset()
            path.unlink()
            self._prune_dirs(path.parent)
            still_used = self.references()
            for digest in digests:
                if not still_used.keeps(digest):
                    with contextlib.suppress(StoreError):
                        self.blob_path(digest).unlink(missing_ok=True)
        return entry

    def _prune_dirs(self, directory: Path) -> None:
        while directory != self.manifests and directory.is_dir() and not any(directory.iterdir()):
            directory.rmdir()
            directory = directory.parent

    def references(self) -> References:
        """Every blob digest some manifest names or, damaged, may name."""
        entries, damaged = self.scan()
        found = References({layer.digest for entry in entries for layer in entry.layers})
        for bad in damaged:
            found.add(bad.digests)
        return found

    def used_digests(self) -> set[str]:
        """Every blob digest some manifest names (damaged ones' included)."""
        return self.references().digests

    # ---- import ------------------------------------------------------------------------
    def import_gguf(self, source: Path, name: str, link: bool = True,
                    source_label: str | None = None,
                    projector: Path | None = None) -> ModelEntry:
        """Verify `source` is a whole GGUF, store it, and name it; with `projector` (a vision
        projector, mmproj GGUF) store that as the manifest's second layer. On an error the
        store is untouched."""
        model = parse_name(name)
        source = Path(source)
        if not _is_file(source):
            raise StoreError(f"{shown_path(source)} does not exist or is not a file")
        try:
            if source.stat().st_size == 0:  # /proc files say 0 and read as anything
                raise StoreError(f"{source} is empty or not a plain file: not a GGUF model")
            header = read_header(source)
        except GGUFError as e:
            raise StoreError(str(e)) from None
        except OSError as e:
            raise StoreError(f"cannot read {source}: {e.strerror or e}") from None
        if header.metadata.get("general.architecture") == "clip":
            raise StoreError(f"{source} is a vision projector, not a model: import the model "
                             f"and pass this file as --mmproj")
        if projector is not None:
            check_projector(Path(projector))
        shape = shape_from_header(header, str(source))
        digest, size = self.add_blob(source, link=link)
        layers = [Layer(MODEL_LAYER, digest, size)]
        if projector is not None:
            proj_digest, proj_size = self.add_blob(Path(projector), link=link)
            layers.append(Layer(PROJECTOR_LAYER, proj_digest, proj_size))
        return self.write_manifest(model, layers, model_details(shape),
                                   source_label or f"import:{source.resolve()}")


def _is_file(path: Path) -> bool:
    """Path.is_file, but a name the system refuses (too long, a loop of links) is no file."""
    try:
        return path.is_file()
    except OSError:
        return False


def shown_path(path: Path | str, limit: int = 200) -> str:
    """A path for a message: a 10 KB one is cut to its start and end."""
    text = str(path)
    return text if len(text) <= limit else f"{text[:limit // 2]}...{text[-limit // 2:]}"


def check_projector(path: Path) -> None:
    """A vision projector GGUF (general.architecture "clip" with a vision encoder), or a
    StoreError saying what the file is instead."""
    if not _is_file(path):
        raise StoreError(f"{shown_path(path)} does not exist or is not a file")
    try:
        md = read_header(path).metadata
    except GGUFError as e:
        raise StoreError(f"{path}: {e}") from None
    if md.get("general.architecture") != "clip" or not md.get("clip.has_vision_encoder"):
        raise StoreError(f"{path} is not a vision projector (an mmproj GGUF has "
                         f"general.architecture 'clip' and a vision encoder)")


def projector_path(store: ModelStore, entry: ModelEntry) -> Path | None:
    """The model's vision projector file, when its manifest has one."""
    layer = entry.companion(PROJECTOR_LAYER)
    return store.blob_path(layer.digest) if layer is not None else None


def default_store() -> ModelStore:
    from localllm import paths

    return ModelStore(paths.models_dir())
