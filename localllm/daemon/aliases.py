"""The names a request may give for a stored model besides its own: the `model_aliases`
setting (localllm/config.py), for the helper models agents ask for that exist only at their
vendor. Every route's model lookup reads it (daemon/api/common.py: find_model); /api/tags and
/api/ps list it for `list` and `ps`."""

from __future__ import annotations

import fnmatch


def alias_target(aliases: dict[str, str], name: str) -> str | None:
    """The model `name` is an alias of: its own entry, else the first glob that matches it
    (in the order the table gives them), else None."""
    if name in aliases:
        return aliases[name]
    return next((target for pattern, target in aliases.items()
                 if fnmatch.fnmatchcase(name, pattern)), None)
