"""Which of a hub repo's GGUF files to pull for this card: the store meets the tuner here.

    candidates: the repo's models (a split GGUF is one; projectors are none)
    shapes:     each one's GGUF header, read by range requests (modelstore.remote_header)
    plans:      the tuner's plan for each on the card at the default context
    pick:       whole on the GPU first, then bits per weight (quality), then predicted decode

modelstore must not import the tuner, so this lives with the commands.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

import aiohttp

from localllm.modelstore.download import RemoteFile, RemoteNotFound
from localllm.modelstore.hub import (
    HubClient, HubFileRef, HubSettings, HubQuantRef, gguf_groups, parse_reference, pick_quant_files,
    quant_label,
)
from localllm.modelstore.remote_header import read_model_header
from localllm.modelstore.shape import ModelShape, shape_from_header
from localllm.planner.card import GIB, Card
from localllm.planner.disk import disk_bytes_per_token
from localllm.planner.plan import Plan
from localllm.planner.budgets import ram_budget
from localllm.planner.search import NoPlanFits, Request
from localllm.planner.tuner import tune

HEADER_READS = 4  # header range requests in flight at once


@dataclass(frozen=True)
class Candidate:
    key: str  # the file, or a split model's stem
    label: str  # the quant, as `--quant` names it
    files: tuple[RemoteFile, ...]
    size: int
    bits_per_weight: float
    n_layers: int  # blocks + 1 (the output layer), as n_gpu_layers counts them
    plan: Plan | None = None  # None: no plan fits this card (`why` says so)
    disk_bytes: int = 0  # weights the plan reads from disk per token
    why: str = ""

    @property
    def fits_gpu(self) -> bool:
        """Every block and the lm-head on the GPU, nothing overridden to the CPU (the token
        table always stays in RAM)."""
        return (self.plan is not None and self.plan.vram_bytes() > 0
                and not self.plan.tensor_overrides and self.plan.n_gpu_layers >= self.n_layers)

    @property
    def decode_tps(self) -> float:
        return self.plan.predicted_decode_tps if self.plan else 0.0

    @property
    def tier(self) -> int:
        """0 whole on the GPU, 1 in VRAM and RAM, 2 reading from disk, 3 no plan."""
        if self.plan is None:
            return 3
        if self.fits_gpu:
            return 0
        return 2 if self.disk_bytes else 1


TIER_WORDS = ("fits wholly on the GPU", "fits in VRAM and RAM", "reads weights from disk",
              "does not fit")


def plan_candidate(key: str, files: tuple[RemoteFile, ...], shape: ModelShape, card: Card,
                   request: Request) -> Candidate:
    """The candidate with its plan on `card` (pure)."""
    bpw = shape.weight_bytes * 8 / max(1, shape.n_params)
    size = sum(f.size or 0 for f in files) or shape.file_size
    base = Candidate(key, quant_label(key), files, size, bpw, shape.n_layer + 1)
    try:
        plan = tune(shape, card, request)
    except NoPlanFits as e:
        return replace(base, why=str(e))
    disk = disk_bytes_per_token(plan.memory, ram_budget(card))
    return replace(base, plan=plan, disk_bytes=disk)


ENOUGH_BITS = 4.5  # past about Q4_K_M, more bits buy little quality for what they cost


def choose(candidates: list[Candidate]) -> Candidate | None:
    """Whole on the GPU first, then the most bits per weight, then the fastest decode. When
    nothing fits whole, bits beyond ENOUGH_BITS count as equal: every extra byte is then read
    from RAM (or disk) on every token, so a Q8_0 at a third of a Q4_K_M's speed loses."""
    usable = [c for c in candidates if c.plan is not None]
    if not usable:
        return None

    def quality(c: Candidate) -> float:
        bits = round(c.bits_per_weight, 2)
        return bits if c.tier == 0 else min(bits, ENOUGH_BITS)

    return min(usable, key=lambda c: (c.tier, -quality(c), -c.decode_tps))


def pick_line(best: Candidate, candidates: list[Candidate], card: Card) -> str:
    """One line: why this file."""
    same_tier = [c for c in candidates if c.tier == best.tier and c is not best]
    higher = [c for c in candidates if c.bits_per_weight > best.bits_per_weight + 0.005
              and c.plan is not None]
    text = (f"picked {best.label}: {TIER_WORDS[best.tier]} of {card.label} at "
            f"{best.bits_per_weight:.2f} bits/weight, predicted {best.decode_tps:.1f} tok/s")
    if higher:  # the next step up in quality, and why it lost
        up = min(higher, key=lambda c: c.bits_per_weight)
        text += (f"; {up.label} ({up.bits_per_weight:.2f} bits/weight) {TIER_WORDS[up.tier]}, "
                 f"{up.decode_tps:.1f} tok/s")
        if best.tier != 0 and up.tier == best.tier:
            text += (f" (when nothing fits wholly on the GPU, past {ENOUGH_BITS} bits/weight "
                     f"speed decides)")
    elif same_tier:
        text += "; the most bits per weight of those that fit as well"
    return text


def table(candidates: list[Candidate], best: Candidate | None) -> list[str]:
    rows = [("", "FILE", "SIZE", "BITS/W", "ON GPU", "DECODE")]
    for c in sorted(candidates, key=lambda c: c.bits_per_weight):
        where = ("whole" if c.fits_gpu else "no plan" if c.plan is None else
                 "part, disk" if c.disk_bytes else "part")
        rows.append(("*" if c is best else "", c.key, f"{c.size / GIB:.1f} GiB",
                     f"{c.bits_per_weight:.2f}", where,
                     f"{c.decode_tps:.2f} tok/s" if c.plan else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w)
                      for i, (cell, w) in enumerate(zip(row, widths, strict=True))).rstrip()
            for row in rows]


def restrict(groups: dict[str, list[RemoteFile]], quants: tuple[str, ...],
             repo: str) -> dict[str, list[RemoteFile]]:
    """Only the groups that hold one of `quants` (a catalog entry's list)."""
    listing = [f for files in groups.values() for f in files]
    kept: dict[str, list[RemoteFile]] = {}
    for quant in quants:
        try:
            files = pick_quant_files(listing, quant, repo)
        except RemoteNotFound:
            continue  # the catalog lists a quant the repo no longer has
        key = next(k for k, v in groups.items() if v == files)
        kept[key] = files
    return kept


async def candidates_from_hub(client: HubClient, repo: str, card: Card, request: Request,
                              quants: tuple[str, ...] = ()) -> tuple[list[Candidate], int]:
    """(each GGUF model of the repo planned on the card, bytes of headers read)."""
    groups = gguf_groups(await client.list_repo(repo))
    if quants:
        groups = restrict(groups, quants, repo)
    if not groups:
        what = f"none of {', '.join(quants)}" if quants else "no GGUF files"
        raise RemoteNotFound(f"hf.co/{repo} has {what}; pull a file as "
                             f"hf.co/{repo}/FILE.gguf or pick another repo")
    limit = asyncio.Semaphore(HEADER_READS)

    async def one(key: str, files: list[RemoteFile]) -> tuple[Candidate, int]:
        async with limit:
            shape, n = await remote_shape(client, repo, files)
        # Planning is pure CPU work; a thread keeps the other header reads moving.
        candidate = await asyncio.to_thread(plan_candidate, key, tuple(files), shape, card,
                                            request)
        return candidate, n

    done = await asyncio.gather(*(one(k, v) for k, v in groups.items()))
    return [c for c, _ in done], sum(n for _, n in done)


async def remote_shape(client: HubClient, repo: str,
                       files: list[RemoteFile]) -> tuple[ModelShape, int]:
    """(a hub model's shape from its GGUF header, bytes read): range requests, no weights."""
    header, n = await read_model_header(client, files, f"hf.co/{repo}")
    return shape_from_header(header, f"hf.co/{repo}/{files[0].filename}"), n


async def source_shape(client: HubClient, source: str) -> tuple[ModelShape, int]:
    """The shape of a catalog entry's hub file (`hf.co/OWNER/REPO:QUANT` or
    `hf.co/OWNER/REPO/FILE.gguf`), read as `pull --quant auto` reads its candidates."""
    reference = parse_reference(source)
    if isinstance(reference, HubQuantRef):
        repo = reference.repo
        files = pick_quant_files(await client.list_repo(repo), reference.quant, repo)
    elif isinstance(reference, HubFileRef):
        repo = reference.repo
        groups = gguf_groups(await client.list_repo(repo))
        files = next((group for group in groups.values()
                      if any(f.filename == reference.path for f in group)), None)
        if files is None:
            raise RemoteNotFound(f"hf.co/{repo} has no {reference.path}")
    else:
        raise RemoteNotFound(f"{source} is no hub file: its header cannot be read remotely")
    return await remote_shape(client, repo, files)


async def with_client(hub: HubSettings, work):
    """`work(client)` with a hub client on a session of its own, its result."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return await work(HubClient(session, hub))
