"""Image files named in a prompt, as `ollama run` takes them: `localllm run MODEL "what is in
./photo.png?"` sends photo.png with the message and the path leaves the text."""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from pathlib import Path

from localllm.units import human_size

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif")
# A path: quoted (spaces allowed) or a run of non-space characters, ending in an image suffix.
_PATH = re.compile(r"""(?:'([^']+)'|"([^"]+)"|(\S+))""")


@dataclass(frozen=True)
class AttachedImage:
    path: Path
    data: bytes

    @property
    def base64(self) -> str:
        return base64.b64encode(self.data).decode("ascii")

    def line(self) -> str:
        return f"added image {self.path.name} ({human_size(len(self.data))})"


def attach_images(prompt: str, cwd: Path | None = None) -> tuple[str, list[AttachedImage]]:
    """The prompt without the image files it names, and those files' contents, in order.
    A word that ends like an image but names no file stays text."""
    cwd = cwd or Path.cwd()
    images: list[AttachedImage] = []

    def take(match: re.Match) -> str:
        word = next(g for g in match.groups() if g is not None)
        clean = word.rstrip("?!.,;:")
        if not clean.lower().endswith(IMAGE_SUFFIXES):
            return match.group(0)
        path = Path(clean).expanduser()
        path = path if path.is_absolute() else cwd / path
        try:
            data = path.read_bytes()
        except OSError:
            return match.group(0)
        images.append(AttachedImage(path, data))
        return word[len(clean):]  # keep the punctuation that followed the path

    text = _PATH.sub(take, prompt)
    return re.sub(r"[ \t]{2,}", " ", text).strip(), images
