"""Planning a catalog model before it is pulled: where its shape comes from, and the one-entry
answer `localllm pull NAME --dry-run` gives ("does 27b-q3 fit my card?").

A shape comes from, in this order:
  the catalog, when its shape was read from the very file the entry pins (same sha256): the
      hub could tell nothing more, so it is not asked
  the hub: the file's own GGUF header, read by range requests (the file as published now)
  the catalog's derived shape, when the hub cannot be reached: an estimate from the published
      config, said so under the plan
Every answer says which it was.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from localllm.errors import UserError
from localllm.modelstore import catalog
from localllm.modelstore.catalog import CatalogEntry
from localllm.modelstore.catalog_shape import model_shape, pins_file
from localllm.modelstore.download import HubUnreachable
from localllm.modelstore.hub import HubSettings
from localllm.modelstore.shape import ModelShape
from localllm.planner.card import Card
from localllm.planner.search import Request

from .pull_progress import size_text
from .quant_pick import TIER_WORDS, Candidate, plan_candidate, table

FROM_CATALOG = "shape from the catalog"
FROM_HUB = "read from the hub"


def entry_shape(entry: CatalogEntry, hub: HubSettings | None = None) -> tuple[ModelShape, str]:
    """(the shape to plan the entry with, where it came from in words)."""
    described = entry.shape
    if described is not None and (entry.repo is None or pins_file(described, entry.sha256)):
        return catalog_model_shape(entry), f"{FROM_CATALOG}: {described.words}"
    if entry.repo is None:
        raise UserError(f"{entry.name} is not on the hub ({entry.source}): pull it first, "
                        f"then tune it")
    from .quant_pick import source_shape, with_client

    try:
        shape, read = asyncio.run(with_client(
            hub or HubSettings.from_environment(),
            lambda client: source_shape(client, entry.source)))
    except HubUnreachable as e:
        if described is None:
            raise
        return catalog_model_shape(entry), (f"{FROM_CATALOG}: {described.words}; "
                                        f"{unreachable(e)}")
    return shape, (f"{FROM_HUB}: the header of {entry.source} ({size_text(read)} read by "
                   "range requests)")


def catalog_model_shape(entry: CatalogEntry) -> ModelShape:
    """The entry's shape from the catalog, named by the entry's quant where it has one: a
    derived shape's header holds only the quant's base type (`UD-Q3_K_XL` is no GGUF file
    type)."""
    shape = model_shape(entry.shape)
    return replace(shape, file_type=entry.quant) if entry.quant else shape


def unreachable(error: HubUnreachable) -> str:
    """The first clause of the hub's error (`cannot reach HOST: why`), for a note."""
    return "the hub could not be reached: " + str(error).split(";")[0]


def display_name(entry: CatalogEntry) -> str:
    return str(entry.name).removesuffix(":latest")


def entry_candidate(entry: CatalogEntry, shape: ModelShape, card: Card,
                    request: Request) -> Candidate:
    """The entry's file planned on the card, as a row of the quants table."""
    key = display_name(entry) + (f" ({entry.quant})" if entry.quant else "")
    return replace(plan_candidate(key, (), shape, card, request), label=entry.quant or key,
                   size=entry.size)


def catalog_candidates(repo: str, quants: tuple[str, ...], card: Card,
                       request: Request) -> list[Candidate]:
    """The quants of a hub repo the catalog carries shapes for (one per entry on that repo),
    planned on the card: `--quant auto --dry-run` when the hub cannot be reached. Only these
    `quants` when some are given (a catalog entry's list)."""
    wanted = {q.lower() for q in quants}
    out = []
    for entry in catalog.entries():
        if entry.repo != repo or entry.shape is None or not entry.quant:
            continue
        if wanted and entry.quant.lower() not in wanted:
            continue
        out.append(entry_candidate(entry, catalog_model_shape(entry), card, request))
    return out


def dry_run_entry(entry: CatalogEntry, card: Card, request: Request,
                  hub: HubSettings | None = None) -> list[str]:
    """`pull NAME --dry-run` for a catalog name: its file planned on the card, where the shape
    came from, and the verdict; a UserError when no plan fits at all."""
    shape, where = entry_shape(entry, hub)
    candidate = entry_candidate(entry, shape, card, request)
    lines = table([candidate], candidate if candidate.plan else None)
    if candidate.plan is None:
        raise UserError(f"{display_name(entry)} does not fit {card.label}: {candidate.why}")
    lines.append(f"{display_name(entry)}: {TIER_WORDS[candidate.tier]} of {card.label} at "
                 f"{candidate.bits_per_weight:.2f} bits/weight, predicted "
                 f"{candidate.decode_tps:.1f} tok/s at context {candidate.plan.n_ctx} "
                 f"(n_gpu_layers={candidate.plan.n_gpu_layers})")
    lines.append(f"({where})")
    return lines
