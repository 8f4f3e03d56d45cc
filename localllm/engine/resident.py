"""Past RAM: the CPU's weights that RAM holds are locked there, so only the rest is read per token.

A plan whose CPU weights exceed its RAM budget (`Plan.streamed_bytes` > 0) leaves them mmapped
in the model file and prices reading the excess from disk for each token. The page cache does
not do that by itself: decode reads every CPU weight once per token, in the same order, and an
LRU over a loop larger than itself evicts each page just before it is needed again. Measured on
a 2-core machine (a 666 MiB Q4_0 model in a 600 MiB memory cgroup, llama.cpp's mapping): 530 MiB
read per token unlocked, 298 with all but 230 MiB locked; on the H200 llama-server --fit decoded
a 37 GiB model in a 24 GiB group at 0.036 tok/s, most of the model read per token.

So the runner maps the file a second time and mlocks the tensors the plan keeps in RAM; pages
are shared between mappings of one file, so llama.cpp's reads find them resident, and only the
streamed tensors cycle through what is left of the page cache. Two conditions:
- the CPU's weights must be the file's pages: llama.cpp repacks Q4_0 and friends for the CPU
  into anonymous buffers (`use_extra_bufts`), which cannot be read back from the file; plans
  that stream turn repacking off (engine/params.py);
- mlock needs RLIMIT_MEMLOCK room (or CAP_IPC_LOCK). Where it falls short, what could be locked
  stays locked and the log says how to raise the limit.

The token table goes first into the streamed set where a token reads one row of it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import resource
from dataclasses import dataclass

from localllm.modelstore.gguf_header import GGUFHeader, read_header
from localllm.modelstore.shape import shape_from_header
from localllm.planner.plan import Plan

BLOCK = re.compile(r"^blk\.(\d+)\.")
TOKEN_TABLE = "token_embd.weight"
OUTPUT = "output.weight"


@dataclass(frozen=True)
class Span:
    name: str
    start: int  # in the file
    end: int


def cpu_tensors(header: GGUFHeader, plan: Plan) -> tuple[list[Span], set[str]]:
    """The tensors llama.cpp leaves on the CPU under `plan`, and those of them a token reads
    one row of. On the CPU: blocks below its GPU layers (llama.cpp's i_gpu_start = n_layer + 1
    - n_gpu_layers), tensors an override sends there, the token table, and the output layer
    when no GPU layer is left for it. The token table is read a row per token unless it is also
    the lm-head (tied embeddings) on the CPU."""
    n_layer = shape_from_header(header, "").n_layer  # llama.cpp's n_layer: NextN included
    on_gpu = any(device != "CPU" for device, _ in plan.device_layers) or plan.n_gpu_layers > 0
    first_gpu = max(0, n_layer + 1 - plan.n_gpu_layers) if on_gpu else n_layer + 1
    to_cpu = [re.compile(o.pattern) for o in plan.tensor_overrides if o.device == "CPU"]
    names = {t.name for t in header.tensors}
    tied = OUTPUT not in names
    # the lm-head: the output layer, or an override (tied: the token table's, as the tuner
    # writes it when it keeps the lm-head in RAM)
    lm_head_on_cpu = first_gpu > n_layer or any(
        p.search(TOKEN_TABLE if tied else OUTPUT) for p in to_cpu)
    spans = []
    for t in header.tensors:
        block = BLOCK.match(t.name)
        index = int(block.group(1)) if block else None
        cpu = (t.name == TOKEN_TABLE or (index is not None and index < first_gpu)
               or (t.name == OUTPUT and lm_head_on_cpu) or any(p.search(t.name) for p in to_cpu))
        if cpu:
            start = header.data_offset + t.offset
            spans.append(Span(t.name, start, start + t.n_bytes))
    return spans, (set() if tied and lm_head_on_cpu else {TOKEN_TABLE})


def split_resident(spans: list[Span], streamed_bytes: int,
                   row_read: set[str] = frozenset()) -> tuple[list[Span], list[Span]]:
    """(resident, streamed): tensors read a row per token first, then the last blocks',
    streamed until `streamed_bytes` are; the rest stays resident."""
    order = sorted(spans, key=lambda s: (s.name not in row_read, -s.start))
    streamed, total = [], 0
    for span in order:
        if total >= streamed_bytes:
            break
        streamed.append(span)
        total += span.end - span.start
    chosen = {s.name for s in streamed}
    return [s for s in spans if s.name not in chosen], streamed


def page_ranges(spans: list[Span]) -> list[tuple[int, int]]:
    """The spans as whole pages, adjacent ones merged (a page shared with a streamed neighbour
    is locked: a page more resident, never one less)."""
    page = mmap.PAGESIZE
    out: list[tuple[int, int]] = []
    for s in sorted(spans, key=lambda s: s.start):
        lo, hi = s.start // page * page, -(-s.end // page) * page
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


class ResidentWeights:
    """The plan's RAM share of the model file, locked in the page cache while this lives."""

    def __init__(self, model_path: str, plan: Plan):
        self.locked_bytes = 0
        self.error = ""
        self._address = self._size = 0
        header = read_header(model_path)
        if int(header.metadata.get("split.count", 1) or 1) > 1:
            self.error = "a split model's other files are not locked"
        spans, row_read = cpu_tensors(header, plan)
        resident, streamed = split_resident(spans, plan.streamed_bytes, row_read)
        self.streamed_bytes = sum(s.end - s.start for s in streamed)
        ranges = page_ranges(resident)
        if not ranges:
            return
        fd = os.open(model_path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        finally:
            os.close(fd)  # the mapping keeps the file
        if address in (None, MAP_FAILED):
            self.error = f"cannot map the model file ({os.strerror(ctypes.get_errno())})"
            return
        self._address, self._size = address, size
        for lo, hi in ranges:
            hi = min(hi, size)
            if _libc.mlock(ctypes.c_void_p(address + lo), hi - lo) != 0:
                self.error = self._lock_failed(ctypes.get_errno())
                break
            self.locked_bytes += hi - lo

    def _lock_failed(self, err: int) -> str:
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft >> 20} MiB"
        return (f"mlock stopped after {self.locked_bytes / GIB:.1f} GiB ({os.strerror(err)}; "
                f"RLIMIT_MEMLOCK {limit}): the page cache may evict weights the next token "
                "needs, and decode read more than planned; raise the limit (`ulimit -l "
                "unlimited` before `localllm serve`, or LimitMEMLOCK=infinity for a system "
                "service)")

    def close(self) -> None:
        if self._address:
            _libc.munmap(ctypes.c_void_p(self._address), self._size)  # unlocks its pages
            self._address = 0

    def report(self) -> dict:
        """What /api/ps shows of it."""
        return {"locked_bytes": self.locked_bytes, "streamed_bytes": self.streamed_bytes,
                "text": self.describe()}

    def describe(self) -> str:
        text = (f"{self.locked_bytes / GIB:.1f} GiB of the weights locked in RAM, "
                f"{self.streamed_bytes / GIB:.1f} GiB read from the model file per token")
        return text + (f"; {self.error}" if self.error else "")


GIB = 1 << 30
MAP_FAILED = ctypes.c_void_p(-1).value
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.mmap.restype = ctypes.c_void_p
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
