"""The store's side of `localllm pull` (the command is cli/pull.py): the progress
bars and `--list`.

The CLI pulls straight into the store (no daemon needed); the per-blob lock in the store's tmp/
makes that safe while the daemon or another `localllm pull` fetches the same model.
"""

from __future__ import annotations

from dataclasses import dataclass

from localllm.modelstore import catalog
from localllm.units import human_size

GIB = 1 << 30
# Room a model needs on the GPU beyond its weights (KV cache at a small context, compute buffers).
WORKING_ROOM_BYTES = 1 * GIB


def catalog_usage_error() -> Exception:
    from localllm.errors import UserError

    return UserError("name a model to pull, e.g. `localllm pull smollm2`; "
                     "`localllm pull --list` shows the catalog")


size_text = human_size  # sizes as `list` and Ollama print them


# ---- progress -------------------------------------------------------------------------
class ProgressView:
    """Ollama's progress objects as rich progress bars (size, speed, ETA), one per blob."""

    def __enter__(self) -> ProgressView:
        from rich.console import Console
        from rich.progress import (
            BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self.console = Console(stderr=True)
        self.progress = Progress(
            TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
            TransferSpeedColumn(), TimeRemainingColumn(), console=self.console,
            transient=False)
        self.tasks: dict[str, int] = {}
        return self

    def update(self, event: dict) -> None:
        status = event.get("status", "")
        if "total" not in event:
            if status not in ("success",):
                self.console.print(status)
            return
        task = self.tasks.get(status)
        if task is None and event["completed"] >= event["total"] and not self.tasks:
            # Stored already (a pull again): a line, not a bar with no speed to show.
            self.console.print(f"{status}: already stored ({size_text(event['total'])})")
            self.tasks[status] = -1
            return
        if task == -1:
            return
        if not any(t != -1 for t in self.tasks.values()):
            # bars start with the first byte: an early error stays one line
            self.progress.start()
        if task is None:
            task = self.tasks[status] = self.progress.add_task(status, total=event["total"])
        self.progress.update(task, total=event["total"], completed=event["completed"])

    def __exit__(self, *exc) -> None:
        if any(t != -1 for t in self.tasks.values()):
            self.progress.stop()


# ---- --list ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Machine:
    label: str
    vram_bytes: int  # all GPUs together, 0 for none
    ram_bytes: int


def detect_machine(card_name: str | None) -> Machine:
    """The GPU(s) to judge fit against: the tuner's probe where it exists, else CPU only."""
    try:
        from localllm.engine.hardware import resolve_card
    except ImportError:
        return Machine("cpu only (no hardware probe available)", 0, 0)
    card = resolve_card(card_name)
    n_gpus = card.n_gpus if card.has_gpu else 0
    usable = max(0, card.free_vram_bytes - card.overhead_bytes) * n_gpus
    return Machine(card.label, usable, card.ram_bytes)


def fit_label(size: int, machine: Machine) -> str:
    """How a model of `size` bytes fits (file size vs memory; the tuner plans the details)."""
    if machine.vram_bytes and size + WORKING_ROOM_BYTES <= machine.vram_bytes:
        return "fits on GPU"
    if machine.vram_bytes:
        on_gpu = max(0, machine.vram_bytes - WORKING_ROOM_BYTES) / size
        if machine.ram_bytes and size > machine.vram_bytes + machine.ram_bytes:
            return "too big"
        return f"partly: ~{on_gpu:.0%} on GPU"
    if machine.ram_bytes and size > machine.ram_bytes:
        return "too big"
    return "cpu"


def catalog_rows(machine: Machine) -> list[tuple[str, ...]]:
    """NAME, SIZE (~ where the hub's figure is rounded), FIT, ALSO (companions), ABOUT (pure)."""
    rows = []
    for entry in catalog.entries():
        also = ", ".join(c.reference.rsplit("/", 1)[-1] for c in entry.companions)
        size = ("" if entry.sha256 else "~") + size_text(entry.size)
        rows.append((str(entry.name).removesuffix(":latest"), size,
                     fit_label(entry.size, machine), also, entry.note))
    return rows


def print_catalog(card_name: str | None) -> None:
    machine = detect_machine(card_name)
    rows = [("NAME", "SIZE", "FIT", "ALSO", "ABOUT"), *catalog_rows(machine)]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    print(f"fit judged for {machine.label} (file size against memory; `localllm tune` plans it)")
    quants = {str(e.name).removesuffix(":latest"): e.quants for e in catalog.entries()}
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True)]
        print("  ".join([*cells, row[4]]))
        if quants.get(row[0]):
            print(f"    quants: {', '.join(quants[row[0]])} (--quant Q, or --quant auto: the "
                  "best that fits)")
    print("pull one with `localllm pull NAME`; hf.co/OWNER/REPO:QUANT and https URLs work too")
