"""The store's housekeeping at daemon start: what a crash or an abandoned upload left behind.

- Blobs no manifest names (nor a damaged one's bytes; while a manifest cannot be read at all,
  no blob is removed): an upload (`POST /api/blobs`) whose create never came, a model
  removed while another process still used it. Swept only past `BLOB_AGE`, so an upload
  waiting for its create, or a pull or import (the CLI's run in their own process) between
  publishing a blob and writing its manifest, keeps it.
- Staging files in tmp/ of imports, creates and uploads cut by a kill: swept past
  `STAGING_AGE` (a live copy touches its file every moment). Downloads a pull can resume
  (`download-<key>.partial` with its `.json` progress, and their lock) stay.

A file's age is from the later of its mtime and ctime: a hard link (an import of a 0600 file)
keeps its source's old mtime, but linking it set its ctime.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from .manifest_io import collection_lock
from .store import ModelStore

BLOB_AGE = 24 * 3600.0
STAGING_AGE = 3600.0
_RESUMABLE_SUFFIXES = (".partial", ".json", ".lock")

log = logging.getLogger("localllm.modelstore")


@dataclass
class Swept:
    blobs: list[str] = field(default_factory=list)  # digests
    staging: list[str] = field(default_factory=list)  # file names in tmp/
    freed: int = 0  # bytes


def _age(path: Path, now: float) -> float:
    info = path.stat()
    return now - max(info.st_mtime, info.st_ctime)


def _resumable(path: Path) -> bool:
    """A pull's download that the next pull of the same file continues."""
    return path.name.startswith("download-") and path.name.endswith(_RESUMABLE_SUFFIXES)


def sweep_store(store: ModelStore, now: float | None = None, blob_age: float = BLOB_AGE,
                staging_age: float = STAGING_AGE) -> Swept:
    now = time.time() if now is None else now
    swept = Swept()
    if store.blobs.is_dir():
        with collection_lock(store.locks, alone=True):
            used = store.references()
            if not used.complete:
                log.warning("store sweep: a manifest cannot be read, so no blob is removed")
            for blob in store.blobs.glob("sha256-*"):
                digest = "sha256:" + blob.name.removeprefix("sha256-")
                if not used.keeps(digest) and _remove_if_old(blob, now, blob_age, swept):
                    swept.blobs.append(digest)
        for bad in store.scan()[1]:
            log.warning("model %s: %s", bad.name, bad.reason)
    if store.tmp.is_dir():
        for path in store.tmp.iterdir():
            if not _resumable(path) and _remove_if_old(path, now, staging_age, swept):
                swept.staging.append(path.name)
    if swept.blobs or swept.staging:
        log.info("store sweep: removed %d unused blobs and %d staging files (%d MiB)",
                 len(swept.blobs), len(swept.staging), swept.freed >> 20)
    return swept


def _remove_if_old(path: Path, now: float, age: float, swept: Swept) -> bool:
    try:
        if path.is_symlink() or not path.is_file() or _age(path, now) < age:
            return False
        size = path.stat().st_size
        os.unlink(path)
    except OSError:
        return False  # gone meanwhile, or not ours to remove: the next start tries again
    swept.freed += size
    return True
