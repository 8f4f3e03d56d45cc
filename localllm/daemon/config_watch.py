"""Apply edits of config.toml while the daemon runs.

The config dir is watched rather than the file: editors save by writing a new file and renaming
it over the old one, which a watch on the old file's inode would miss, and the file may not
exist yet when the daemon starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import watchfiles

from localllm.config import RESTART_NEEDED, Config, ConfigError, changed_settings, load_config


async def watch_config(path: Path, apply: Callable[[Config], None], log: logging.Logger,
                       initial: Config | None = None) -> None:
    """Run until cancelled: on each change of `path`, load the config and hand a valid one that
    differs from the one in force to `apply`. An invalid file is logged with its line and
    reason, and the config in force stays. A removed file means defaults (and environment).

    `initial` is the config the daemon started with; without it the file is read now.
    """
    path = Path(path)
    current = initial if initial is not None else _load_or_none(path, log)
    path.parent.mkdir(parents=True, exist_ok=True)
    loop = asyncio.get_running_loop()

    def is_config(_change: watchfiles.Change, changed: str) -> bool:
        return Path(changed) == path

    def adopt(new: Config | None) -> None:  # on the loop: the daemon's state is the loop's
        nonlocal current
        if new is None or new == current:
            return
        changed = changed_settings(current, new) if current is not None else ()
        log.info("config reloaded", extra={"file": str(path), "changed": ",".join(changed)})
        restart = [name for name in changed if name in RESTART_NEEDED]
        if restart:
            log.warning("restart needed to apply %s (localllm service restart)",
                        ", ".join(restart), extra={"settings": ",".join(restart)})
        try:
            apply(new)
        except Exception:
            log.exception("applying the new config failed", extra={"file": str(path)})
            return
        current = new

    def reload(_changes) -> None:  # in the watch's thread: the file is read there
        new = _load_or_none(path, log)
        with contextlib.suppress(RuntimeError):  # the loop closed first: shutting down
            loop.call_soon_threadsafe(adopt, new)

    await _watch(path.parent, is_config, reload)


def _load_or_none(path: Path, log: logging.Logger) -> Config | None:
    """The config now, or None (logged) when the edit is bad: a bad edit never ends the watch."""
    try:
        return load_config(path)
    except ConfigError as e:
        log.error("config invalid, keeping the last good one: %s", e,
                  extra={"file": e.path or str(path), "line": e.line or "", "reason": e.reason})
    except Exception as e:  # anything else a half-written or odd file raises
        log.error("config unreadable, keeping the last good one: %s: %s", type(e).__name__, e,
                  extra={"file": str(path)})
    return None


async def watch_profiles(directory: Path, log: logging.Logger) -> None:
    """Run until cancelled: check each edited tuned profile at once and log whether it is
    valid. The scheduler reads profiles at every load (profiles.choose), so a valid edit takes
    effect at the next load; an invalid one is reported now, and the tuner plans instead."""
    from localllm.profiles.saved import ProfileError, load_profile

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)

    def is_profile(change: watchfiles.Change, changed: str) -> bool:
        # A tuned profile is <model>@<card>.toml; acceptance.toml and calibration.toml, which
        # the daemon and the tuner write beside them, are measurements, not profiles.
        name = Path(changed).name
        return change != watchfiles.Change.deleted and name.endswith(".toml") and "@" in name

    def check(changes) -> None:  # in the watch's thread: a profile is read there, never on
        for _change, changed in changes:  # the loop (paths.read_regular: no FIFO, no device)
            try:
                load_profile(Path(changed), set_aside_broken=False)  # maybe mid-edit
            except ProfileError as e:
                log.error("tuned profile invalid, the tuner will plan instead: %s", e,
                          extra={"file": changed})
            else:
                log.info("tuned profile changed; it applies at the next load",
                         extra={"file": changed})

    await _watch(directory, is_profile, check, recursive=True)


async def _watch(directory: Path, keep: Callable[[watchfiles.Change, str], bool],
                 on_changes: Callable[[set], None], recursive: bool = False) -> None:
    """Until cancelled: `on_changes(changes)`, in the watch's thread (the files it reads are
    anyone's: never on the event loop), for each batch of changes in `directory` that `keep`
    admits. The watch runs in a thread of its own (not the loop's
    executor, which it would hold for good): watchfiles' async watch wakes the event loop every
    5 s to look for a stop (its Rust timeout), and each wake would run this coroutine between a
    request's steps; the thread's watch looks for its stop without the loop."""
    loop = asyncio.get_running_loop()
    stop = threading.Event()
    ended: asyncio.Future[None] = loop.create_future()

    def tell(outcome: BaseException | None) -> None:
        if not ended.done():
            if outcome is None:
                ended.set_result(None)
            else:
                ended.set_exception(outcome)

    def run() -> None:
        outcome = None
        try:
            for changes in watchfiles.watch(directory, watch_filter=keep, stop_event=stop,
                                            recursive=recursive, raise_interrupt=False):
                on_changes(changes)
        except Exception as e:  # the folder went away, the watcher failed: the task says so
            outcome = e
        with contextlib.suppress(RuntimeError):  # the loop closed first
            loop.call_soon_threadsafe(tell, outcome)

    threading.Thread(target=run, name=f"watch {directory}", daemon=True).start()
    try:
        await ended
    finally:
        stop.set()
