"""The prompt cache on disk: long prompts' sequence states kept past the runner, so that a
conversation whose model was unloaded (`localllm stop`, keep_alive, a daemon restart, a reboot)
gets its prefix back instead of reading it again (an agent's 20K-token system prompt and tools:
tens of seconds on a GPU too small for the model).

A prompt goes to disk when the RAM prompt cache (reuse.py's `PromptCache`) drops it for room,
when it is larger than that cache, and, for every slot and every prompt still in RAM, when the
runner ends (`save_all`, within SHUTDOWN_WRITE_S: the daemon kills a runner that takes longer).
Evictions are written by a thread of their own, so the slot loop does not wait on the disk.

A request whose prompt has at least MIN_TOKENS tokens looks here after the RAM cache
(reuse.py): the file sharing the longest usable prefix with it is read, checked, and restored
into the slot like a RAM entry; a file that fails its checks is deleted with a warning and the
prompt is read as if there were none. The files (disk_format.py) sit under
`<cache dir>/prompts/<key>/`, one folder per key, so a context reads only the folder of its
own model and KV layout; all the folders share one budget in bytes (setting
prompt_cache_disk), the least recently used file (by its modification time, which a restore
renews) deleted first, whichever runner wrote it.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from pathlib import Path

from localllm.engine.loaded import LoadedModel
from localllm.engine.state import SavedSequence

from localllm.paths import private_dir, stale_temporary

from . import disk_format
from .disk_format import DamagedFile, FileEntry
from .reuse import common_prefix

log = logging.getLogger("localllm.runner")
# Shorter prompts stay in RAM only: reading 1K tokens again costs about a second on a CPU and
# far less on a GPU, while each file costs a disk write and a share of the budget; agents'
# prefixes (system prompt and tools) are 10-20K tokens.
MIN_TOKENS = 1024
# RunnerProcess.stop (engine/local.py) gives a runner 10 s to end before it kills it.
SHUTDOWN_WRITE_S = 8.0
MAX_PENDING = 4  # evicted prompts waiting for the writer (in RAM): more are not written


class DiskCache:
    def __init__(self, root: Path, budget_bytes: int, model: LoadedModel, model_path: str,
                 keep_contained: bool):
        """`root`: the folder of every key's folder; `budget_bytes`: what all its files may
        hold together; `keep_contained`: as PromptCache's (a sliding-window or recurrent
        state is continued only from near its end, so a shorter prompt is kept beside a
        longer one that starts with it)."""
        self.root = root
        self.budget = budget_bytes
        self.model = model
        self.model_path = model_path
        self.keep_contained = keep_contained
        # read by reuse.py as a plain value: a short prompt never calls in here
        self.min_tokens = MIN_TOKENS
        self._key_of: tuple[object, str] = (None, "")  # the loaded LlamaModel, its key
        self._index: dict[str, list[FileEntry]] = {}  # key -> its folder's files, read once
        self._lock = threading.Lock()  # the index, between the loop and the writer
        self._queue: queue.Queue[tuple[SavedSequence, str] | None] = queue.Queue()
        self._writer: threading.Thread | None = None

    def key(self) -> str:
        """The key of the context loaded now (a fill band switch loads another)."""
        lm = self.model.lm
        if self._key_of[0] is not lm:
            self._key_of = (lm, disk_format.kv_key(self.model_path, self.model.plan, lm))
        return self._key_of[1]

    # ---- reading ---------------------------------------------------------------------------
    def best(self, tokens: list[int], usable) -> tuple[FileEntry | None, int]:
        """The file that gives `tokens` the longest reusable prefix and that prefix's length
        (`usable(entry, common)`: the model's reuse rules, as for RAM entries)."""
        with self._lock:
            entries = list(self._entries(self.key()))
        best, best_n = None, 0
        for entry in entries:
            n = usable(entry, common_prefix(entry.tokens, tokens))
            if n > best_n:
                best, best_n = entry, n
        return best, best_n

    def load(self, entry: FileEntry) -> SavedSequence | None:
        """The file's sequence, checked whole; None (the file deleted, with a log line) when
        it is damaged or gone."""
        started = time.perf_counter()
        try:
            saved = disk_format.read_saved(entry)
        except FileNotFoundError:  # the budget's trim by another runner, or a user
            log.info("prompt cache on disk: %s is gone", entry.path.name)
            self._forget(entry)
            return None
        except (DamagedFile, OSError) as e:
            log.warning("prompt cache on disk: %s is damaged (%s): deleted, the prompt is read "
                        "instead", entry.path, e)
            self._delete(entry)
            return None
        saved.kv_key = entry.key
        try:
            os.utime(entry.path)  # its last use, for the budget's LRU order
        except OSError:
            pass
        log.info("prompt cache on disk: read %d tokens (%.1f MiB) from %s in %.0f ms",
                 len(saved.tokens), entry.nbytes / 2**20, entry.path.name,
                 (time.perf_counter() - started) * 1e3)
        return saved

    # ---- writing ---------------------------------------------------------------------------
    def put(self, saved: SavedSequence, key: str) -> None:
        """Write `saved` (a prompt the RAM cache let go) from the writer thread, if it is long
        enough to be worth a file; `key`: the context it was saved from."""
        if len(saved.tokens) < MIN_TOKENS or saved.nbytes > self.budget:
            return
        if self._queue.qsize() >= MAX_PENDING:
            log.info("prompt cache on disk: %d prompts wait for the disk already; %d tokens "
                     "not written", MAX_PENDING, len(saved.tokens))
            return
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_queued, daemon=True,
                                            name="prompt-cache-writer")
            self._writer.start()
        self._queue.put((saved, key))

    def _write_queued(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self.write(*item)
            except OSError as e:  # a full or read-only disk loses the file, not the runner
                log.warning("prompt cache on disk: could not write %d tokens: %s",
                            len(item[0].tokens), e)

    def drain(self, deadline: float) -> None:
        """Let the writer finish what waits (until `deadline`, time.monotonic) and end."""
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join(max(0.0, deadline - time.monotonic()))

    def write(self, saved: SavedSequence, key: str) -> bool:
        """Write `saved` as a file of `key` now, unless a file already holds its tokens, and
        keep the budget; True when written."""
        if len(saved.tokens) < MIN_TOKENS or saved.nbytes > self.budget:
            return False
        with self._lock:
            entries = self._entries(key)
            n = len(saved.tokens)
            for entry in entries:
                if common_prefix(entry.tokens, saved.tokens) == n and \
                        (len(entry.tokens) == n or not self.keep_contained):
                    _touch(entry.path)  # already on disk: only its last use is new
                    return False
        started = time.perf_counter()
        path = private_dir(private_dir(self.root) / key) / disk_format.file_name(saved.tokens)
        size = disk_format.write(path, saved, key)
        entry = FileEntry(path, tuple(saved.tokens), saved.pos_min, tuple(
            disk_format.CheckpointInfo(c.n_tokens, c.kind, c.nbytes) for c in saved.checkpoints),
            len(saved.data), size, key)
        with self._lock:
            entries = self._entries(key)
            covered = [] if self.keep_contained else [
                e for e in entries if e.path != path and len(e.tokens) < n
                and common_prefix(e.tokens, saved.tokens) == len(e.tokens)]
            gone = {path, *(e.path for e in covered)}
            entries[:] = [e for e in entries if e.path not in gone]
            entries.append(entry)
        for old in covered:  # the new file serves every prompt these did
            self._delete(old)
        log.info("prompt cache on disk: wrote %d tokens with %d checkpoints (%.1f MiB) as %s "
                 "in %.0f ms", n, len(saved.checkpoints), size / 2**20, path.name,
                 (time.perf_counter() - started) * 1e3)
        self.trim()
        return True

    def trim(self) -> None:
        """Delete the least recently used files of every key until all fit the budget (and
        what writers killed midway left)."""
        files = []
        for path in self.root.glob("*/*"):
            try:
                if stale_temporary(path):
                    path.unlink(missing_ok=True)
                elif path.suffix == disk_format.SUFFIX:
                    info = path.stat()
                    files.append((info.st_mtime_ns, info.st_size, path))
            except OSError:
                continue  # deleted meanwhile
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.budget:
                break
            path.unlink(missing_ok=True)
            total -= size
            with self._lock:
                for entries in self._index.values():
                    entries[:] = [e for e in entries if e.path != path]
            log.info("prompt cache on disk: deleted %s (least recently used) for room; "
                     "%.1f of %.1f MiB", path.name, total / 2**20, self.budget / 2**20)

    # ---- the index ---------------------------------------------------------------------------
    def _entries(self, key: str) -> list[FileEntry]:
        """The files of `key`'s folder (read the first time, the lock held)."""
        if key in self._index:
            return self._index[key]
        entries = []
        folder = self.root / key
        for path in sorted(folder.glob(f"*{disk_format.SUFFIX}")) if folder.is_dir() else ():
            try:
                entries.append(disk_format.read_entry(path, key))
            except FileNotFoundError:
                continue
            except (DamagedFile, OSError) as e:
                log.warning("prompt cache on disk: %s is damaged (%s): deleted", path, e)
                path.unlink(missing_ok=True)
        self._index[key] = entries
        return entries

    def _forget(self, entry: FileEntry) -> None:
        with self._lock:
            entries = self._index.get(entry.key, [])
            entries[:] = [e for e in entries if e.path != entry.path]

    def discard(self, entry: FileEntry) -> None:
        """Delete a file llama.cpp refused although its key matched."""
        log.warning("prompt cache on disk: %s deleted", entry.path)
        self._delete(entry)

    def _delete(self, entry: FileEntry) -> None:
        self._forget(entry)
        try:
            entry.path.unlink(missing_ok=True)
        except OSError:
            pass


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass
