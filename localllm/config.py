"""Settings: defaults, overridden by config.toml in the config dir, overridden by LOCALLLM_* env.

| setting           | env                         | default                          |
| ----------------- | --------------------------- | -------------------------------- |
| host              | LOCALLLM_HOST               | 127.0.0.1:11435                  |
| socket            | LOCALLLM_SOCKET             | $XDG_RUNTIME_DIR/localllm/localllm.sock |
| api_key           | LOCALLLM_API_KEY            | (none; required off loopback)    |
| keep_alive        | LOCALLLM_KEEP_ALIVE         | 5m                               |
| max_loaded_models | LOCALLLM_MAX_LOADED_MODELS  | 2                                |
| max_queue         | LOCALLLM_MAX_QUEUE          | 64                               |
| default_model     | LOCALLLM_DEFAULT_MODEL      | smollm2                          |
| default_ctx       | LOCALLLM_CONTEXT_LENGTH     | 4096                             |
| vram_margin_mib   | LOCALLLM_VRAM_MARGIN_MIB    | 512                              |
| hf_endpoint       | LOCALLLM_HF_ENDPOINT        | https://huggingface.co           |
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path

from . import paths


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Config:
    host: str = f"{paths.DEFAULT_TCP_HOST}:{paths.DEFAULT_TCP_PORT}"
    socket: str = ""
    api_key: str = ""
    keep_alive: str = "5m"
    max_loaded_models: int = 2
    max_queue: int = 64
    default_model: str = "smollm2"
    default_ctx: int = 4096
    vram_margin_mib: int = 512
    hf_endpoint: str = "https://huggingface.co"

    @property
    def socket_path(self) -> Path:
        return Path(self.socket) if self.socket else paths.socket_path()

    @property
    def tcp(self) -> tuple[str, int]:
        return paths.parse_host(self.host)

    @property
    def keep_alive_seconds(self) -> float | None:
        return parse_duration(self.keep_alive)


ENV = {
    "host": "LOCALLLM_HOST",
    "socket": "LOCALLLM_SOCKET",
    "api_key": "LOCALLLM_API_KEY",
    "keep_alive": "LOCALLLM_KEEP_ALIVE",
    "max_loaded_models": "LOCALLLM_MAX_LOADED_MODELS",
    "max_queue": "LOCALLLM_MAX_QUEUE",
    "default_model": "LOCALLLM_DEFAULT_MODEL",
    "default_ctx": "LOCALLLM_CONTEXT_LENGTH",
    "vram_margin_mib": "LOCALLLM_VRAM_MARGIN_MIB",
    "hf_endpoint": "LOCALLLM_HF_ENDPOINT",
}

_DURATION = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")


def parse_duration(value: str | int | float | None) -> float | None:
    """Ollama's keep_alive: seconds as a number, or '5m', '1h', '30s'; negative means forever.

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
    return None if seconds < 0 else seconds


def config_file() -> Path:
    return paths.config_dir() / "config.toml"


def _coerce(name: str, value, source: str):
    kind = {f.name: f.type for f in fields(Config)}[name]
    try:
        if kind == "int":
            if isinstance(value, bool):
                raise ValueError
            return int(value)
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: {name} must be {'a number' if kind == 'int' else 'text'}, "
                          f"not {value!r}") from None


def parse_config(text: str, source: str = "config.toml") -> dict:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: {e}") from None
    known = {f.name for f in fields(Config)}
    values = {}
    for key, value in doc.items():
        if key not in known:
            raise ConfigError(f"{source}: unknown setting {key!r} (known: {', '.join(sorted(known))})")
        values[key] = _coerce(key, value, source)
    return values


def load_config(path: Path | None = None, environ: dict | None = None) -> Config:
    """Defaults < config file < environment. Raises ConfigError with the file and reason."""
    path = path or config_file()
    environ = os.environ if environ is None else environ
    config = Config()
    if path.is_file():
        config = replace(config, **parse_config(path.read_text(), str(path)))
    overrides = {
        name: _coerce(name, environ[env], env) for name, env in ENV.items() if environ.get(env)
    }
    config = replace(config, **overrides)
    validate(config)
    return config


def validate(config: Config) -> None:
    paths.parse_host(config.host)
    parse_duration(config.keep_alive)
    if config.max_loaded_models < 1:
        raise ConfigError("max_loaded_models must be at least 1")
    if config.max_queue < 1:
        raise ConfigError("max_queue must be at least 1")
    if config.default_ctx < 256:
        raise ConfigError("default_ctx must be at least 256")
