"""Make `localllm.*` importable from a plain checkout, for scripts run on the GPU machine
(which has no package registry and so no editable install)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def bootstrap() -> None:
    """Make `localllm.*` importable from a plain checkout (the GPU machine has no editable
    install): a shim package whose subpackages point at the top-level folders."""
    try:
        import localllm.profiles  # noqa: F401
        return
    except ImportError:
        # A plain `localllm/` folder on sys.path may have been imported half: forget it.
        for name in [n for n in sys.modules if n == "localllm" or n.startswith("localllm.")]:
            del sys.modules[name]
    shim = Path(tempfile.gettempdir()) / "localllm-shim"
    pkg = shim / "localllm"
    if not pkg.exists():
        shutil.copytree(ROOT / "localllm", pkg)
        for name in ("modelstore", "profiles", "daemon", "tui", "cli", "llama"):
            (pkg / name).symlink_to(ROOT / name)
    sys.path.insert(0, str(shim))
    # Children (the runner's load, dry runs) put their working directory first on sys.path,
    # where the real `localllm/` folder would hide the shim: run everything from elsewhere.
    os.chdir(shim)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(shim), str(ROOT / "scripts"), *filter(None, [os.environ.get("PYTHONPATH")])])
