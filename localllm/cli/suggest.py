"""The one line of a "no such model" error, made useful: the nearest names stored or in the
catalog ("did you mean"), and a `localllm pull NAME` only where that pull would work. Every
command that takes a model (run, pull, show, rm, stop, cp, create, launch) ends its errors
through here (cli/main.py)."""

from __future__ import annotations

import difflib
import re

_NOT_FOUND = re.compile(r"model '([^']+)' (?:not found|is not in the catalog)")
_PULL_HINT = re.compile(r",? or `localllm pull ([^`]+)`")


def model_names() -> list[str]:
    """Stored and catalog names, as a user types them."""
    from localllm.modelstore import catalog
    from localllm.modelstore.store import default_store

    names = [str(e.name) for e in default_store().list()]
    names += [str(name) for name in catalog.load_catalog()]
    return sorted({n.removesuffix(":latest") for n in names})


def nearest(name: str, names: list[str] | None = None, cutoff: float = 0.6) -> str | None:
    """The stored or catalog name closest to `name` (None: nothing close enough)."""
    names = model_names() if names is None else names
    close = difflib.get_close_matches(name.lower().removesuffix(":latest"), names, n=1,
                                      cutoff=cutoff)
    return close[0] if close else None


def nearest_names(name: str, n: int = 3, cutoff: float = 0.6) -> list[str]:
    """Up to `n` stored or catalog names close to `name`, the closest first."""
    return difflib.get_close_matches(name.lower().removesuffix(":latest"), model_names(), n=n,
                                     cutoff=cutoff)


def known_model(name: str) -> bool:
    """A model a command can use: stored, in the catalog, or a hub or URL reference (pulled
    on use)."""
    from localllm.modelstore import catalog
    from localllm.modelstore.names import BadModelName, parse_name
    from localllm.modelstore.store import default_store

    try:
        parsed = parse_name(name)
    except BadModelName:
        return False
    if name.startswith(("hf.co/", "huggingface.co/", "https://")):
        return True
    return default_store().exists(parsed) or catalog.lookup(parsed) is not None


def pullable(name: str) -> bool:
    from localllm.modelstore import catalog

    return catalog.lookup(name) is not None


def with_suggestion(message: str) -> str:
    """`message` with a did-you-mean for the model it says is missing, and without a pull hint
    that names something no pull could fetch."""
    found = _NOT_FOUND.search(message)
    if not found or "did you mean" in message:
        return message
    missing = found.group(1).removesuffix(":latest")
    hint = _PULL_HINT.search(message)
    if hint and hint.group(1) != missing and pullable(missing):
        return message[:hint.start()] + f", or `localllm pull {missing}`" + message[hint.end():]
    if hint and not pullable(hint.group(1)):
        message = message[:hint.start()] + message[hint.end():]
    try:
        close = nearest(found.group(1))
    except Exception:  # a store that cannot be listed: the message as it was
        return message
    if close and close != found.group(1).removesuffix(":latest"):
        message = f"{message.rstrip('. ')}; did you mean '{close}'?"
    return message
