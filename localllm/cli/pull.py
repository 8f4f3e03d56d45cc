"""`localllm pull NAME [--quant Q|auto] [--card NAME] [--dry-run]` and `localllm pull --list`.

A hub repo named without a quant (`hf.co/OWNER/REPO`), or a catalog name with `--quant auto`,
has its GGUF files planned for the card and the best one pulled (localllm.cli.quant_pick); every
other name pulls what it names (localllm.modelstore.pull).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass, replace

from localllm.errors import UserError
from localllm.modelstore import catalog
from localllm.modelstore.download import DownloadOptions, resumable_bytes
from localllm.modelstore.hub import (
    HubQuantRef, HubSettings, parse_reference, pick_quant_files, store_name,
)
from localllm.modelstore.pull import pull_model
from localllm.cli.pull_progress import (
    ProgressView, catalog_usage_error, print_catalog, size_text,
)
from localllm.modelstore.store import default_store

AUTO = "auto"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "pull", help="download a model (catalog name, hf.co/OWNER/REPO[:QUANT], or a URL)",
        description="Download a model into the store, verified. NAME is a catalog name (see "
                    "--list), hf.co/OWNER/REPO[:QUANT], hf.co/OWNER/REPO/FILE.gguf or "
                    "https://.../FILE.gguf. A repo without a quant has each GGUF planned for "
                    "this card and the best pulled: whole on the GPU first, then the most bits "
                    "per weight (past 4.5 counting alike when nothing fits whole), then the "
                    "fastest. An interrupted pull resumes when run again. "
                    "Gated repos need HF_TOKEN; LOCALLLM_HF_ENDPOINT points at another hub.")
    parser.add_argument("model", nargs="?", metavar="NAME")
    parser.add_argument("--list", action="store_true",
                        help="show the catalog with sizes and which models fit this machine")
    parser.add_argument("--quant", metavar="Q|auto",
                        help="the quant to pull from a repo or catalog entry that offers several "
                             "(auto: plan them all for the card and pick)")
    parser.add_argument("--card", metavar="NAME",
                        help="judge fit and pick the quant for this card profile instead of "
                             "the GPU here")
    parser.add_argument("--dry-run", action="store_true",
                        help="show the quants, their plans and the pick; download nothing")
    parser.set_defaults(func=run)


@dataclass(frozen=True)
class Target:
    text: str  # what to pull, when nothing is picked
    pick_repo: str | None = None  # plan this repo's files and pick one
    quants: tuple[str, ...] = ()  # only these (a catalog entry's list)
    forced: str | None = None  # show the plans, but take this quant
    store_as: str | None = None


def resolve_target(name: str, quant: str | None, dry_run: bool) -> Target:
    """What `pull NAME --quant Q` means (pure, no network)."""
    reference = parse_reference(name)
    if isinstance(reference, HubQuantRef):
        if quant and reference.quant and quant.lower() != reference.quant.lower():
            raise UserError(f"{name} names quant {reference.quant} and --quant says {quant}: "
                            "give one")
        wanted = quant or reference.quant
        if wanted is None or wanted.lower() == AUTO:
            return Target(name, reference.repo,
                          store_as=str(store_name(HubQuantRef(reference.repo, None))))
        text = f"hf.co/{reference.repo}:{wanted}"
        return Target(text, reference.repo if dry_run else None, forced=wanted)
    entry = catalog.lookup(name) if reference is None else None
    if quant is None:
        return Target(name)
    if entry is None:
        raise UserError("--quant applies to hf.co/OWNER/REPO and to catalog names that list "
                        "quants (`localllm pull --list`)")
    if not entry.quants or entry.repo is None:
        raise UserError(f"{entry.name} comes in one quant; pull hf.co/OWNER/REPO:QUANT for "
                        "another")
    if quant.lower() == AUTO:
        return Target(name, entry.repo, entry.quants)
    match = next((q for q in entry.quants if q.lower() == quant.lower()), None)
    if match is None:
        raise UserError(f"{entry.name} offers {', '.join(entry.quants)}, not {quant}")
    text = f"hf.co/{entry.repo}:{match}"
    return Target(text, entry.repo if dry_run else None, entry.quants, forced=match)


def run(args: argparse.Namespace) -> int:
    if args.list:
        print_catalog(args.card)
        return 0
    if not args.model:
        raise catalog_usage_error()
    target = resolve_target(args.model, args.quant, args.dry_run)
    hub = HubSettings.from_environment()
    if target.pick_repo:
        target = pick(target, hub, args.card, offline_ok=args.dry_run)
        if args.dry_run:
            print("dry run: nothing downloaded")
            return 0
    elif args.dry_run:
        from localllm.modelstore.pull import plan_pull

        planned = plan_pull(target.text)  # a name no pull can fetch fails here as it would
        entry = catalog.lookup(args.model) if parse_reference(args.model) is None else None
        if entry is None:
            print(f"would pull {planned.source_label}; --dry-run plans catalog names, "
                  "hf.co/OWNER/REPO and hf.co/OWNER/REPO:QUANT")
            return 0
        print(f"would pull {planned.source_label}")
        return dry_run(entry, hub, args.card)
    store = default_store()
    started = time.time()
    try:
        with ProgressView() as view:
            entry = asyncio.run(pull_model(store, target.text, view.update, hub=hub,
                                           options=DownloadOptions(), store_as=target.store_as))
    except KeyboardInterrupt:
        print(interrupted(store, args.model, started), file=sys.stderr)
        return 130
    print(f"pulled {entry.name} ({size_text(entry.size)}, {entry.digest[:19]})")
    return 0


def interrupted(store, name: str, started: float) -> str:
    """What an interrupted pull left: the bytes a rerun resumes from, or nothing."""
    kept = resumable_bytes(store, since=started)
    if kept:
        return (f"pull interrupted: {size_text(kept)} downloaded are kept in {store.tmp}; "
                f"`localllm pull {name}` resumes from there")
    return f"pull interrupted: nothing was kept; `localllm pull {name}` starts it again"


def dry_run(entry: catalog.CatalogEntry, hub: HubSettings, card_name: str | None) -> int:
    """`pull NAME --dry-run` for a catalog name: does its file fit the card, and how. A name
    with no shape to plan from (no hub, none in the catalog) is still a name the pull takes:
    the dry run says why it is not planned."""
    from localllm.engine.hardware import resolve_card
    from localllm.modelstore.download import HubUnreachable
    from localllm.profiles.calibration import calibrated

    from .catalog_fit import dry_run_entry, unreachable

    card = calibrated(resolve_card(card_name))
    try:
        lines = dry_run_entry(entry, card, pick_request(), hub)
    except HubUnreachable as e:
        lines = [f"not planned: the catalog carries no shape for it and {unreachable(e)}"]
    for line in lines:
        print(line)
    print("dry run: nothing downloaded")
    return 0


def pick(target: Target, hub: HubSettings, card_name: str | None,
         offline_ok: bool = False) -> Target:
    """Plan the repo's candidates, print them and the pick; the Target that pulls it. With
    `offline_ok` (a dry run) a hub that cannot be reached leaves the quants the catalog
    carries shapes for."""
    from localllm.engine.hardware import resolve_card
    from localllm.modelstore.download import HubUnreachable
    from localllm.profiles.calibration import calibrated

    from .catalog_fit import FROM_CATALOG, catalog_candidates, unreachable
    from .quant_pick import candidates_from_hub, choose, pick_line, table, with_client

    card = calibrated(resolve_card(card_name))
    repo = target.pick_repo
    try:
        candidates, header_bytes = asyncio.run(with_client(
            hub, lambda client: candidates_from_hub(client, repo, card, pick_request(),
                                                    target.quants)))
        where = (f"planned at context {pick_request().n_ctx} from each file's GGUF header: "
                 f"{size_text(header_bytes)} read by range requests")
    except HubUnreachable as e:
        candidates = catalog_candidates(repo, target.quants, card, pick_request()) \
            if offline_ok else []
        if not candidates:
            raise
        where = (f"{FROM_CATALOG}: planned at context {pick_request().n_ctx} the "
                 f"{len(candidates)} quants of hf.co/{repo} it carries shapes for, derived "
                 f"from the published configs (estimates); {unreachable(e)}")
    if target.forced:
        best = forced_candidate(candidates, target.forced, repo)
    else:
        best = choose(candidates)
    for line in table(candidates, best):
        print(line)
    print(f"({where})")
    if best is None:
        smallest = min(candidates, key=lambda c: c.size)
        raise UserError(f"no quant of hf.co/{repo} fits {card.label}: even {smallest.label} "
                        f"({size_text(smallest.size)}) has no plan; try a smaller model")
    if target.forced:
        print(f"{best.label}: as asked (--quant)")
        return target
    print(pick_line(best, candidates, card))
    if not best.files:  # planned from the catalog: a dry run, which pulls nothing
        return target
    store_as = target.store_as or f"hf.co/{repo}:{best.label}"
    return replace(target, text=f"hf.co/{repo}/{best.files[0].filename}", store_as=store_as)


def forced_candidate(candidates: list, quant: str, repo: str):
    """The candidate `--quant` names: by its files (read from the hub), else by its label (a
    catalog shape, which has no files)."""
    files = [f for c in candidates for f in c.files]
    if not files:
        match = next((c for c in candidates if c.label.lower() == quant.lower()), None)
        if match is None:
            raise UserError(f"the catalog carries no shape for {quant} of hf.co/{repo}, and "
                            "the hub could not be reached to read its header")
        return match
    files = pick_quant_files(files, quant, repo)
    return next(c for c in candidates if c.files == tuple(files))


def pick_request():
    """The config's tuner settings at its default context, one slot: how the daemon would load
    each candidate at first."""
    from localllm.config import ConfigError, load_config
    from localllm.profiles.choose import config_request

    try:
        n_ctx = load_config().default_ctx
    except ConfigError:
        n_ctx = 4096
    return replace(config_request(), n_ctx=n_ctx, num_parallel=1)
