"""How the store reads and writes its manifests so that two writers cannot tear it, and how
it tells which blobs a manifest, damaged or not, may still name.

- Writes: each writer its own temporary file beside the manifest (mkstemp: a unique name, 0600
  from its creation), fsynced and renamed over the manifest. Two `create`s or `cp`s to one name
  each rename a whole manifest; the last one stands.
- Locks (flock, one file per name under `locks/`): a write and a removal of one name take its
  lock; every manifest write takes the store's collection lock shared, and a removal (or the
  start-up sweep) takes it alone while it works out which blobs no manifest names and deletes
  them. flock's locks belong to an open file, so threads of one daemon exclude each other as
  well as the CLI's processes do.
- Damaged manifests: the blob digests their bytes still hold are kept (a damaged manifest is
  quarantined, not ignored); one that cannot be read at all keeps every blob.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from localllm.paths import private_dir

# A manifest is a few hundred bytes; one past this is damaged (and its bytes are scanned, up to
# SCAN_AT_MOST, for the blobs it may name).
MANIFEST_AT_MOST = 1 << 20
SCAN_AT_MOST = 64 << 20
_DIGEST = re.compile(rb"sha256[:-]([0-9a-f]{64})")


class ManifestUnreadable(ValueError):
    """The manifest's bytes are not a manifest (too large, not JSON, nested past any use)."""


def read_manifest_doc(path: Path) -> dict:
    """The manifest's JSON object; ManifestUnreadable for anything else (OSError passes)."""
    with path.open("rb") as f:
        raw = f.read(MANIFEST_AT_MOST + 1)
    if len(raw) > MANIFEST_AT_MOST:
        raise ManifestUnreadable(f"larger than {MANIFEST_AT_MOST >> 20} MiB")
    try:
        doc = json.loads(raw)
    except RecursionError:
        raise ManifestUnreadable("nested too deeply to be a manifest") from None
    except ValueError as e:
        raise ManifestUnreadable(f"not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ManifestUnreadable(f"a JSON {type(doc).__name__}, not an object")
    return doc


def referenced_digests(path: Path) -> frozenset[str] | None:
    """Every blob digest the bytes of a (damaged) manifest hold, or None when they cannot be
    read whole: then no blob may be taken as unreferenced."""
    try:
        with path.open("rb") as f:
            raw = f.read(SCAN_AT_MOST + 1)
    except OSError:
        return None
    if len(raw) > SCAN_AT_MOST:
        return None
    return frozenset(f"sha256:{m.group(1).decode()}" for m in _DIGEST.finditer(raw))


@dataclass
class References:
    """The blobs the store's manifests name; `complete` False when a manifest could not be read:
    then every blob is kept."""

    digests: set[str] = field(default_factory=set)
    complete: bool = True

    def keeps(self, digest: str) -> bool:
        return not self.complete or digest in self.digests

    def add(self, digests: frozenset[str] | None) -> None:
        if digests is None:
            self.complete = False
        else:
            self.digests |= digests


def write_atomically(path: Path, doc: dict) -> None:
    """`doc` as `path`'s JSON, through a temporary file of this writer's own (a hidden name the
    store's listing skips); nothing half-written is ever at `path`, and a failure leaves no
    temporary file."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(doc, indent=2).encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise


@contextlib.contextmanager
def _flock(path: Path, mode: int) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)  # closing the descriptor lets the lock go


@contextlib.contextmanager
def name_lock(locks: Path, tagged: str) -> Iterator[None]:
    """One writer (or remover) of the manifest of `tagged` at a time."""
    private_dir(locks)
    key = hashlib.sha256(tagged.encode()).hexdigest()[:32]
    with _flock(locks / f"name-{key}.lock", fcntl.LOCK_EX):
        yield


@contextlib.contextmanager
def collection_lock(locks: Path, alone: bool) -> Iterator[None]:
    """Shared by manifest writers; held alone while unreferenced blobs are found and deleted, so
    that no manifest naming a blob appears between the two."""
    private_dir(locks)
    with _flock(locks / "collect.lock", fcntl.LOCK_EX if alone else fcntl.LOCK_SH):
        yield
