"""What a setting's text means as a value: sizes, durations, GPU indices, fill bands and
host:port endpoints, each read one way wherever it is given (config.toml, LOCALLLM_*
variables, `localllm config set`, the API's keep_alive); ConfigError says what is wrong."""

from __future__ import annotations

import re

from .errors import UserError


class ConfigError(UserError, ValueError):
    """A bad setting. `path` and `line` say where, when it came from a file."""

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None,
                 reason: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.line = line
        self.reason = reason or message


_DURATION = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt])?(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(value: str) -> int | None:
    """A memory size ("24G", "24GiB", "20000M", bytes as a bare number) in bytes, or None for
    `auto`; ConfigError otherwise. Units are binary (G = GiB)."""
    if str(value).strip().lower() == "auto":
        return None
    m = _SIZE.match(str(value))
    if not m:
        raise ConfigError(f"invalid size {value!r}: use auto or e.g. 24G, 20000M")
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, None: 1}[
        m.group(2).lower() if m.group(2) else None]
    return int(float(m.group(1)) * scale)


def parse_duration(value: str | float | None) -> float | None:
    """Ollama's keep_alive: seconds as a number, or '5m', '1h', '30s'; negative (or 100 years
    and more) means forever.

    Returns seconds, or None for forever.
    """
    if value is None:
        return 300.0
    if isinstance(value, bool):
        raise ConfigError(f"invalid duration {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        m = _DURATION.match(str(value))
        if not m:
            raise ConfigError(f"invalid duration {value!r}: use e.g. 30s, 5m, 1h, 0 or -1")
        scale = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}[m.group(2)]
        seconds = float(m.group(1)) * scale
    # 100 years or more is forever too (as Ollama holds it): a wall-clock time that far off
    # overflows the dates /api/ps reports.
    return None if seconds < 0 or seconds >= FOREVER_SECONDS else seconds


FOREVER_SECONDS = 100 * 365.25 * 86400


def parse_gpus(value: str) -> tuple[int, ...] | None:
    """The gpus setting: None for `all`, else the GPU indices (nvidia-smi's); ConfigError for
    anything else."""
    if str(value).strip().lower() == "all":
        return None
    parts = [t.strip() for t in str(value).split(",")]
    if not parts or not all(t.isdigit() for t in parts) or len(set(parts)) != len(parts):
        raise ConfigError(f"gpus must be all or GPU indices such as 0,1, not {value!r}")
    return tuple(int(t) for t in parts)


def parse_bands(value: str) -> tuple[int, ...] | str:
    """The fill_bands setting: `auto`, `off`, or the bands' token counts, rising."""
    word = str(value).strip().lower()
    if word in ("auto", "off"):
        return word
    parts = [t.strip() for t in word.split(",")]
    if not all(t.isdigit() for t in parts):
        raise ConfigError(f"fill_bands must be auto, off or token counts such as 8192,32768, "
                          f"not {value!r}")
    bands = tuple(int(t) for t in parts)
    if list(bands) != sorted(set(bands)) or bands[0] < 256:
        raise ConfigError(f"fill_bands must rise and start at 256 tokens or more, not {value!r}")
    return bands


def parse_endpoint(text: str) -> tuple[str, int]:
    """An RPC worker's "host:port" -> (host, port); ValueError says what is wrong."""
    host, sep, port = str(text).strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"RPC worker {text!r} is not host:port (e.g. 192.168.1.20:50052)")
    return host.strip("[]"), int(port)


def parse_table(name: str, value: object) -> dict[str, str]:
    """A table of names to names (model_aliases): a TOML table, or `a=b,c=d` as the variable
    and `localllm config set` give it; ConfigError says which entry is wrong."""
    if isinstance(value, str):
        pairs = [part.split("=", 1) for part in value.split(",") if part.strip()]
        if any(len(pair) != 2 for pair in pairs):
            raise ConfigError(f"{name} must be name=model pairs separated by commas, "
                              f"not {value!r}")
        value = {key.strip(): target.strip() for key, target in pairs}
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a table of name = model, not {value!r}")
    for key, target in value.items():
        if not isinstance(target, str) or not key.strip() or not target.strip():
            raise ConfigError(f"{name}: {key!r} must name a model, not {target!r}")
    return {key.strip(): target.strip() for key, target in value.items()}
