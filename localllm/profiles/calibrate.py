"""`localllm tune --calibrate`: measure the card's real memory and host-to-device bandwidth with
torch (the optional extra; engine/bandwidth.py, in the engine's child program) and the host's
disk read rate, and store them with the calibration.

Without torch the tuner uses the theoretical figures NVML gives (memory clock x bus width, PCIe
generation x width: see hardware.card_from_nvml); those are peaks no kernel reaches, which is
what the measured figures correct. The disk rate (plans past RAM read weights from disk, see
planner.disk) is the host's, so it is stored under `[host]`, for every card planned here.
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path

import tomli_w

from localllm.errors import UserError

from localllm.planner.card import Card
from localllm.planner.plan import physical_cores
from localllm.engine.probes import Bandwidth, Calibrate
from .calibration import calibration_file, load_calibration, update_host, with_measured_bandwidth
from localllm.engine.probing import ProbeFailed, ask

GB = 1e9


def store_bandwidth(card_name: str, measured: Bandwidth, path: Path | None = None) -> dict:
    path = path or calibration_file()
    doc = load_calibration(path)
    entry = dict(doc.get(card_name, {}))
    entry["memory_bandwidth_gbs"] = round(measured.memory_gbs, 1)
    entry["pcie_gbs"] = round(measured.host_to_device_gbs, 1)
    entry["bandwidth_measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    doc[card_name] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(doc))
    return entry


DISK_READ_BYTES = 2 << 30  # enough to get past a drive's own cache and readahead
PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class DiskRead:
    gbs: float
    bytes_read: int
    how: str  # how the file was read and the page cache kept out of the figure, for the user


def measure_disk_read(path: Path, max_bytes: int = DISK_READ_BYTES,
                      threads: int | None = None) -> DiskRead:
    """Time reading up to `max_bytes` of `path` the way decode reads weights past RAM: page
    faults through a mapping of the file (llama.cpp's use_mmap), from one thread per core, each
    over its own contiguous span as the compute threads split a tensor's rows. A sequential
    O_DIRECT read of large blocks is faster (2.4 GB/s on the H200 host, where decode read at
    about 1.3), and a plan priced at it predicted decode 35% too fast. The file's cached pages
    are dropped first (posix_fadvise DONTNEED; pages another process holds mapped stay, so the
    figure may include cache)."""
    import threading

    import numpy as np

    try:
        st = os.stat(path)
    except OSError as e:
        raise UserError(f"cannot read {path} to time the disk: {e.strerror}") from None
    if st.st_size < 64 << 20:
        raise UserError(f"{path} is too small to time the disk (less than 64 MiB)")
    if st.st_blocks * 512 < st.st_size // 2:
        raise UserError(f"{path} is mostly holes (a sparse file): reading it does not touch the "
                        "disk; calibrate with a model that is stored in full")
    threads = max(1, threads or physical_cores())
    span = min(max_bytes, st.st_size) // threads // PAGE * PAGE
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            os.fsync(fd)  # DONTNEED drops only clean pages: a just-written model has dirty ones
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            how = "page cache dropped with posix_fadvise; pages mapped elsewhere may remain"
        except (OSError, AttributeError):
            how = "the page cache could not be dropped: the figure may include it"
        mapping = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    # held in a list so that it can be let go before the mapping closes (a live view of a
    # mapping keeps it from closing)
    pages = [np.frombuffer(mapping, dtype=np.uint8)]

    def touch(i: int) -> None:  # one byte per page faults it in; numpy's sum frees the GIL
        int(pages[0][i * span:(i + 1) * span:PAGE].sum())

    try:
        workers = [threading.Thread(target=touch, args=(i,)) for i in range(threads)]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        seconds = time.perf_counter() - start
    finally:
        pages.clear()
        mapping.close()
    done = span * threads
    return DiskRead(done / max(seconds, 1e-9) / GB, done,
                    f"page faults through a mapping from {threads} threads; {how}")


def store_disk_read(measured: DiskRead, path: Path | None = None) -> dict:
    return update_host({"disk_read_gbs": round(measured.gbs, 2), "disk_read_how": measured.how,
                        "disk_measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}, path)


def calibrate(card: Card) -> tuple[Bandwidth, Card]:
    """The card's bandwidths measured with torch in the engine's child program (engine/bandwidth.py)
    and stored; the card as the tuner now sees it."""
    try:
        measured = ask(Calibrate(), timeout=300)
    except ProbeFailed as e:
        raise UserError(str(e)) from None
    store_bandwidth(card.name, measured)
    return measured, with_measured_bandwidth(card, load_calibration()[card.name])
