"""The daemon's own state files survive any content.

The tuner's records (workload.json, draft acceptance, expert-cache hits, eval results,
calibration), saved profiles and chats are files that a torn write, a full disk or any local
process can leave in any shape. None of them may stop a model from loading: a file that cannot
be read as what it should be is logged once, set aside beside itself as NAME.bad-TIMESTAMP (never
deleted: it may be worth a look) and a fresh one is started. Writes go through a temporary file,
fsync and rename (paths.replace_private), so a reader sees the old file or the new one.

    with unless_broken(path, "the workload record"):
        return parse(path)          # any content error: set aside, then past the block
    return default
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("localllm.state")


def set_aside(path: Path, what: str, error: BaseException) -> Path | None:
    """Rename a broken state file to NAME.bad-TIMESTAMP beside it; the new name, or None when
    it was gone already (another reader set it aside first)."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    for n in range(100):
        aside = path.with_name(f"{path.name}.bad-{stamp}" + (f"-{n}" if n else ""))
        if aside.exists():
            continue
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("%s %s is unreadable (%s) and could not be set aside (%s)", what, path,
                        _why(error), e)
            return None
        log.warning("%s %s was unreadable (%s): set aside as %s, starting a new one", what,
                    path, _why(error), aside.name)
        return aside
    return None


def _why(error: BaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__


@contextlib.contextmanager
def unless_broken(path: Path, what: str) -> Iterator[None]:
    """Run the block that reads `path`; a content error of any kind (not JSON or TOML, bytes
    that are not UTF-8, nesting too deep, a value of the wrong type or size) sets the file aside
    and is suppressed, so that the code after the block gives the default. Errors of the disk
    itself (OSError) are not the file's content: they pass."""
    try:
        yield
    except OSError:
        raise
    except Exception as e:  # any content at all: that is the point
        set_aside(path, what, e)
