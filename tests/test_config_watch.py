"""Editing config.toml while the watcher runs: a good edit is applied without a restart, a broken
one is logged with its line and the config in force stays. Real files, real watchfiles."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from localllm.config import Config, config_file, load_config
from localllm.daemon.config_watch import watch_config

DEADLINE_S = 20


class RecordQueue(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: asyncio.Queue[logging.LogRecord] = asyncio.Queue()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.put_nowait(record)


async def _write_until(path: Path, text: str, arrived: asyncio.Queue):
    """Write the file and wait for what the watcher produces. The write is repeated until it
    is seen, because a watcher that has only just started may not be listening yet."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        draft = path.with_name(".config.toml.draft")  # saved the way editors do: a rename
        draft.write_text(text)
        draft.replace(path)
        try:
            return await asyncio.wait_for(arrived.get(), timeout=1.0)
        except TimeoutError:
            continue
    pytest.fail(f"the watcher did not react to {text!r} within {DEADLINE_S}s")


async def test_edits_apply_live_and_broken_edits_keep_the_old_config(home):
    path = config_file()
    path.parent.mkdir(parents=True)
    path.write_text('keep_alive = "5m"\nmax_queue = 64\n')
    applied: asyncio.Queue[Config] = asyncio.Queue()
    log = logging.getLogger("test.config_watch")
    log.propagate = False
    records = RecordQueue()
    log.addHandler(records)
    task = asyncio.create_task(watch_config(path, applied.put_nowait, log,
                                            initial=load_config(path)))
    try:
        new = await _write_until(path, 'keep_alive = "30s"\nmax_queue = 2\n', applied)
        assert (new.keep_alive_seconds, new.max_queue) == (30.0, 2)

        error = await _write_until(path, 'keep_alive = "30s"\nmax_queue = -1\n', records.records)
        while error.levelno < logging.ERROR:  # the info line of the good edit may come first
            error = await asyncio.wait_for(records.records.get(), DEADLINE_S)
        assert error.file == str(path) and error.line == 2
        assert "max_queue must be at least 1" in error.reason
        assert applied.empty()  # nothing applied: the last good config stays in force

        new = await _write_until(path, 'keep_alive = "30s"\nmax_queue = 2\nhost = ":12345"\n',
                                 applied)
        assert new.tcp == ("127.0.0.1", 12345)
        messages = [records.records.get_nowait().getMessage()
                    for _ in range(records.records.qsize())]
        assert any("restart needed to apply host" in m for m in messages), messages

        path.unlink()  # no file: back to the defaults
        new = await asyncio.wait_for(applied.get(), DEADLINE_S)
        assert new == Config()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
