"""Settings: defaults, overridden by config.toml in the config dir, overridden by LOCALLLM_* env.

| setting           | env                        | default                       | applied   |
| ----------------- | -------------------------- | ----------------------------- | --------- |
| host              | LOCALLLM_HOST              | 127.0.0.1:11435               | restart   |
| socket            | LOCALLLM_SOCKET            | (runtime dir)/localllm.sock   | restart   |
| api_key           | LOCALLLM_API_KEY           | (none; required off loopback) | restart   |
| origins           | LOCALLLM_ORIGINS           | (none; localhost only)        | restart   |
| allowed_hosts     | LOCALLLM_ALLOWED_HOSTS     | (none; localhost only)        | restart   |
| shared_machine    | LOCALLLM_SHARED_MACHINE    | False                         | restart   |
| import_dirs       | LOCALLLM_IMPORT_DIRS       | ('~',)                        | live      |
| keep_alive        | LOCALLLM_KEEP_ALIVE        | 5m                            | live      |
| max_loaded_models | LOCALLLM_MAX_LOADED_MODELS | 2                             | live      |
| num_parallel      | LOCALLLM_NUM_PARALLEL      | auto                          | next load |
| max_queue         | LOCALLLM_MAX_QUEUE         | 64                            | live      |
| queue_timeout     | LOCALLLM_QUEUE_TIMEOUT     | 5m                            | live      |
| load_timeout      | LOCALLLM_LOAD_TIMEOUT      | 10m                           | live      |
| default_model     | LOCALLLM_DEFAULT_MODEL     | smollm2                       | live      |
| default_ctx       | LOCALLLM_CONTEXT_LENGTH    | 4096                          | next load |
| context_policy    | LOCALLLM_CONTEXT_POLICY    | fit                           | next load |
| kv_cache_type     | LOCALLLM_KV_CACHE_TYPE     | auto                          | next load |
| quality           | LOCALLLM_QUALITY           | balanced                      | next load |
| expected_fill     | LOCALLLM_EXPECTED_FILL     | 0.5                           | next load |
| workload          | LOCALLLM_WORKLOAD          | auto                          | next load |
| vram_margin_mib   | LOCALLLM_VRAM_MARGIN_MIB   | 512                           | next load |
| ram_budget        | LOCALLLM_RAM_BUDGET        | auto                          | next load |
| gpus              | LOCALLLM_GPUS              | all                           | next load |
| hf_endpoint       | LOCALLLM_HF_ENDPOINT       | https://huggingface.co        | restart   |
| log_level         | LOCALLLM_LOG_LEVEL         | info                          | live      |
| rpc_workers       | LOCALLLM_RPC_WORKERS       | ()                            | next load |
| remote_timeout    | LOCALLLM_REMOTE_TIMEOUT    | 300                           | live      |
| image_urls        | LOCALLLM_IMAGE_URLS        | on                            | live      |
| prompt_cache_ram  | LOCALLLM_PROMPT_CACHE_RAM  | auto                          | next load |
| prompt_cache_disk | LOCALLLM_PROMPT_CACHE_DISK | 4096                          | next load |
| fill_bands        | LOCALLLM_FILL_BANDS        | auto                          | next load |
| expert_cache      | LOCALLLM_EXPERT_CACHE      | auto                          | next load |
| expert_misses     | LOCALLLM_EXPERT_MISSES     | auto                          | next load |
| expert_cache_device | LOCALLLM_EXPERT_CACHE_DEVICE | gpu                       | next load |
| model_aliases     | LOCALLLM_MODEL_ALIASES     | {}                            | live      |

- num_parallel: the most requests one loaded model serves at once (llama.cpp sequences, each
  slot with its own KV cache of the full context). `auto`: as many as fit beside the tuner's
  placement without moving weights off the GPU (on a CPU-only machine: in the RAM budget), at
  most 4; a number is a cap on the same rule.
- max_queue: requests that may wait (for a slot or a load) over all models; past it, 503 with
  Retry-After. queue_timeout: how long one may wait before the same 503.
- load_timeout: a runner that has not loaded its model by then is stopped and the request fails
  (a hung GPU driver must not wedge the daemon).
- default_ctx: the context a model loads with when a request names no num_ctx (Ollama's
  OLLAMA_CONTEXT_LENGTH). Under `fit` it is the smallest context the tuner gives (more where
  the GPU holds it at no cost in speed; never past the model's trained length), under `fixed`
  exactly this.
- context_policy: `fixed` uses default_ctx (or the request's num_ctx) and spills to the CPU when
  it does not fit; `fit` shrinks the context until the model fits on the GPU; `max` takes the
  largest context that fits, up to the model's trained length.
- kv_cache_type: `auto` lets the planner choose (under `quality`); `f16`, `bf16`, `q8_0` or
  `q4_0` pin K and V (the types default CUDA builds have flash-attention kernels for);
  `q8_0/q4_0` pins q8_0 K with q4_0 V (on a GPU this pair attends on the CPU).
- quality: how much output quality the KV cache may cost, a threshold on the KL divergence that
  `localllm eval` measures (assumed figures until it has): `max` (f16 unless measured as good),
  `balanced` (f16 or q8_0; 4 bits only where no more precise setting keeps the context's KV on
  the GPU) or `speed` (any, the fastest).
- workload: the session the tuner starts planning a model for, `chat` (short prompts, most
  conversations stay shallow), `agent` (a long system prompt that grows by tool results turn
  after turn) or `auto`: chat, or agent for a model first asked through /v1/messages,
  /v1/responses or with tools. Whichever it is, once a model has served 4 requests its next
  load is planned for the mix it served (the daemon keeps the lengths of its last 24 prompts
  and answers in the state dir, `workload.json`, 0600). The plan minimizes the session's total
  time, prompt reading and decode at each depth (planner.workload has the lengths); a fill
  band above the first is planned for the long prompt that enters it; `tune` and `ps` say which
  workload a plan is for and where it came from.
- expected_fill: the older form of workload, kept: when set (in the file or the environment) the
  session is one short prompt and an answer that fills this part of the context, 0.05 to 1.
- ram_budget: host RAM a model may use, `auto` (what is available when it loads: MemAvailable,
  capped by the cgroup's memory limit, v2 or v1) or a size (`24G`, `20000M`); weights past it
  stay in the mmapped file and are read from disk per token, while the runner locks the rest
  in RAM (mlock: `ulimit -l` must allow it, else /api/ps and the log say how far it got).
- gpus: which GPUs models may use, `all` or their indices as nvidia-smi lists them (`0,2`),
  within what CUDA_VISIBLE_DEVICES leaves visible; the tuner splits layers over them by
  layer, and may still leave one out where the others run the model faster.
- log_level: debug, info, warning or error.
- origins: comma-separated browser origins allowed to call the API (CORS), as OLLAMA_ORIGINS:
  `https://app.example.com,chrome-extension://*`; `*` matches anything. Localhost origins
  (http/https, any port) are always allowed; a request from any other origin gets a 403.
- allowed_hosts: comma-separated extra names the TCP port answers to in the `Host` header
  (`*.lan` wildcards work). Localhost names, loopback IPs and the bound address always pass;
  any other name gets a 403 (protection against DNS rebinding).
- shared_machine: where the daemon cannot tell which local user opened a TCP connection (not
  Linux), `true` asks every TCP request for the API key. On Linux another user's loopback
  connection always needs the key, whatever this says.
- import_dirs: folders (default `~`, your home) whose files a TCP client may name in
  /api/import and a Modelfile's `FROM /path` (the Unix socket, which only you can open, may
  name any file you can read). A path outside them is refused with the same message as a
  missing one.
- rpc_workers: `["host:port", ...]` (comma-separated in the variable): `localllm worker`s whose
  devices models may use besides this machine's; the planner measures each one's memory and
  link. RPC has no authentication: trusted networks only.
- image_urls: `on` lets an OpenAI `image_url` name an http(s) URL, which the daemon fetches (at
  most 20 MiB, 10 s, no redirect to a private address); `off` takes only `data:` URLs and base64.
- remote_timeout: seconds a remote model's server (`localllm remote add`) may take to start
  its answer, and between two parts of it, before the request fails with 504.
- prompt_cache_ram: MiB of RAM per loaded model for the prompts of slots taken by other
  requests (an agent's side requests between its turns): the slot's KV is copied there first,
  and a later request starting with that prompt gets it back instead of reading it again.
  Least recently used first out. `auto`: a quarter of the RAM free when the model loads, at
  most 8 GiB; 0 turns it off.
- prompt_cache_disk: MiB of disk (the cache dir's `prompts/`, all models) for prompts of 1024
  tokens or more, written as they leave RAM or their model unloads, restored when a prompt
  starts with one (docs/prompt-cache.md). Least recently used first out; 0 turns it off.
- fill_bands: plans per fill band. A model loads with the plan of a smaller context first (less
  KV on the GPU leaves room for more of the weights: faster while the context is short); when a
  sequence is about to outgrow it, the runner reloads with the next band's plan and carries
  every sequence's KV over (a pause of a model load; ps and the log show it), and back down once
  that band went unneeded for 5 minutes. `auto`: the tuner's bands (8K, 32K, then the whole
  context) where their placement differs from the whole context's and they decode faster after a
  short prompt (or measure an MoE way), on a GPU, for plans the tuner made (not a saved profile,
  a draft model or a vision projector); `off`: one plan for the whole context; token counts
  (`4096,16384`): these bands, on any machine.
- expert_cache: a VRAM pool of the MoE experts a plan keeps in RAM (docs/expert-cache.md). `auto`:
  the tuner prices pool sizes and none on a GPU, from the model's measured hits (a pool 15 points
  off its price loads again once, priced from them); `off` (or 0); or N slots. ps shows hits.
- expert_misses: who computes the experts that pool misses, on a GPU: `cpu` (llama.cpp's way for
  experts in RAM: each such block's hidden state goes to the CPU and back), `gpu` (the GPU reads
  them where they lie in pinned RAM, over PCIe: a step never leaves the GPU; not past RAM) or
  `auto` (the tuner prices both and keeps the faster). ps says which ran.
- expert_cache_device: where the pool goes: `gpu` (the first GPU) or `cpu` (in RAM, where the
  CPU computes hits and misses alike: no gain in speed, for tests and development on a machine
  without a GPU; only a number of slots turns it on there).
- model_aliases: names (or globs: `claude-haiku-*`) a request may give for a stored model, for
  the helper models agents ask for that exist only at their vendor (Copilot CLI's
  `gpt-5.4-nano`, Claude Code's small fast model): a `[model_aliases]` table of name = model,
  `name=model,...` in the variable. A stored model of that name comes first; `ps` and `list`
  show them; `launch copilot` adds the ones it needs (and says so).

The runtime dir is $XDG_RUNTIME_DIR/localllm (the state dir where there is none).
"restart": the daemon keeps its listening sockets, API key and hub until `localllm service
restart` (or a new `localllm serve`); the CLI reads the file on every run. The rest is applied
while the daemon runs; "next load" means models loaded from then on (a loaded model keeps its
plan until it is unloaded).
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import asdict, dataclass, field, fields, replace
from functools import cached_property
from pathlib import Path

import tomli_w

from . import paths
from .kv_types import KV_SETTINGS
from .config_values import (
    ConfigError, parse_bands, parse_duration, parse_endpoint, parse_gpus, parse_size, parse_table,
)


def setting(default, env: str, *, words: tuple[str, ...] = (), least: float | None = None,
            most: float | None = None, besides: tuple[str, ...] = ("auto",)):
    """One setting, declared whole: its default, its LOCALLLM_* variable, the words it takes
    (`words`), its bounds as a number (`least`, `most`) and, for a number-or-word setting, the
    words it takes besides a number (`besides`). check_setting and coerce apply them."""
    rules = {"env": env, "words": words, "least": least, "most": most, "besides": besides}
    if isinstance(default, dict):  # a table: each Config gets its own copy
        return field(default_factory=lambda: dict(default), metadata=rules)
    return field(default=default, metadata=rules)


@dataclass(frozen=True)
class Config:
    host: str = setting(f"{paths.DEFAULT_TCP_HOST}:{paths.DEFAULT_TCP_PORT}", "LOCALLLM_HOST")
    socket: str = setting("", "LOCALLLM_SOCKET")
    api_key: str = setting("", "LOCALLLM_API_KEY")
    origins: str = setting("", "LOCALLLM_ORIGINS")
    allowed_hosts: str = setting("", "LOCALLLM_ALLOWED_HOSTS")
    shared_machine: bool = setting(False, "LOCALLLM_SHARED_MACHINE")
    import_dirs: tuple[str, ...] = setting(("~",), "LOCALLLM_IMPORT_DIRS")
    keep_alive: str = setting("5m", "LOCALLLM_KEEP_ALIVE")
    max_loaded_models: int = setting(2, "LOCALLLM_MAX_LOADED_MODELS", least=1)
    num_parallel: int | str = setting("auto", "LOCALLLM_NUM_PARALLEL", least=1, most=64)
    max_queue: int = setting(64, "LOCALLLM_MAX_QUEUE", least=1)
    queue_timeout: str = setting("5m", "LOCALLLM_QUEUE_TIMEOUT")
    load_timeout: str = setting("10m", "LOCALLLM_LOAD_TIMEOUT")
    default_model: str = setting("smollm2", "LOCALLLM_DEFAULT_MODEL")
    default_ctx: int = setting(4096, "LOCALLLM_CONTEXT_LENGTH", least=256)
    context_policy: str = setting("fit", "LOCALLLM_CONTEXT_POLICY", words=("fixed", "fit", "max"))
    kv_cache_type: str = setting("auto", "LOCALLLM_KV_CACHE_TYPE",
                                 words=("auto", *KV_SETTINGS))
    quality: str = setting("balanced", "LOCALLLM_QUALITY", words=("max", "balanced", "speed"))
    expected_fill: float = setting(0.5, "LOCALLLM_EXPECTED_FILL", least=0.05, most=1.0)
    workload: str = setting("auto", "LOCALLLM_WORKLOAD", words=("auto", "chat", "agent"))
    vram_margin_mib: int = setting(512, "LOCALLLM_VRAM_MARGIN_MIB", least=0)
    ram_budget: str = setting("auto", "LOCALLLM_RAM_BUDGET")
    gpus: str = setting("all", "LOCALLLM_GPUS")
    hf_endpoint: str = setting("https://huggingface.co", "LOCALLLM_HF_ENDPOINT")
    log_level: str = setting("info", "LOCALLLM_LOG_LEVEL",
                             words=("debug", "info", "warning", "error"))
    rpc_workers: tuple[str, ...] = setting((), "LOCALLLM_RPC_WORKERS")
    remote_timeout: int = setting(300, "LOCALLLM_REMOTE_TIMEOUT", least=1)
    image_urls: str = setting("on", "LOCALLLM_IMAGE_URLS", words=("on", "off"))
    prompt_cache_ram: int | str = setting("auto", "LOCALLLM_PROMPT_CACHE_RAM", least=0)
    prompt_cache_disk: int = setting(4096, "LOCALLLM_PROMPT_CACHE_DISK", least=0)
    fill_bands: str = setting("auto", "LOCALLLM_FILL_BANDS")
    expert_cache: int | str = setting("auto", "LOCALLLM_EXPERT_CACHE", least=0,
                                      besides=("off", "auto"))
    expert_misses: str = setting("auto", "LOCALLLM_EXPERT_MISSES", words=("auto", "cpu", "gpu"))
    expert_cache_device: str = setting("gpu", "LOCALLLM_EXPERT_CACHE_DEVICE",
                                       words=("gpu", "cpu"))
    model_aliases: dict[str, str] = setting({}, "LOCALLLM_MODEL_ALIASES")

    @property
    def socket_path(self) -> Path:
        return Path(self.socket) if self.socket else paths.socket_path()

    @property
    def tcp(self) -> tuple[str, int]:
        return paths.parse_host(self.host)

    @property
    def import_roots(self) -> tuple[Path, ...]:
        """import_dirs as absolute, resolved folders (`~` expanded)."""
        return tuple(Path(d).expanduser().resolve() for d in self.import_dirs)

    # The durations every request reads (the scheduler's keep_alive and queue wait): parsed
    # once per Config (a changed config.toml makes a new one), not on each request.
    @cached_property
    def keep_alive_seconds(self) -> float | None:
        return parse_duration(self.keep_alive)

    @cached_property
    def queue_timeout_seconds(self) -> float:
        return max(0.0, parse_duration(self.queue_timeout) or 0.0)

    @property
    def load_timeout_seconds(self) -> float:
        return max(1.0, parse_duration(self.load_timeout) or 0.0)


# Settings only the daemon reads (its scheduler and planner): set in a client command's
# environment they change nothing in a daemon that is already running (localllm.client says so).
DAEMON_ONLY = ("max_loaded_models", "num_parallel", "max_queue", "queue_timeout",
               "load_timeout", "default_ctx", "context_policy", "kv_cache_type",
               "expected_fill", "vram_margin_mib", "ram_budget", "gpus", "prompt_cache_ram",
               "prompt_cache_disk", "fill_bands", "expert_misses", "expert_cache_device",
               "keep_alive")


# Each setting's LOCALLLM_* variable, as its declaration names it.
ENV = {f.name: f.metadata["env"] for f in fields(Config)}

# Settings the daemon takes only when it starts (sockets are bound, the auth middleware and the
# pull route hold theirs): a change while it runs logs "restart needed".
RESTART_NEEDED = frozenset({"host", "socket", "api_key", "origins", "allowed_hosts",
                            "shared_machine", "hf_endpoint"})

# Tables of config.toml that belong to one client: [keys] is the chat TUI's key bindings
# (localllm.tui.keys reads and checks it).
CLIENT_TABLES = frozenset({"keys"})

# A Unix socket path must fit sockaddr_un.sun_path (108 bytes with the terminating NUL).
_MAX_SOCKET_PATH = 107

def config_file() -> Path:
    return paths.config_dir() / "config.toml"


def setting_names() -> tuple[str, ...]:
    return tuple(f.name for f in fields(Config))


_FIELDS = {f.name: f for f in fields(Config)}


def _kind(name: str) -> str:
    return _FIELDS[name].type


def coerce(name: str, value: object) -> bool | int | float | str | tuple[str, ...]:
    """A raw value (TOML, env or command line) as the setting's type; ConfigError if it is not."""
    if name not in ENV:
        raise ConfigError(f"unknown setting {name!r} (known: {', '.join(setting_names())})")
    if _kind(name) == "int | str":  # a number, or the words it takes besides one
        words = _FIELDS[name].metadata["besides"]
        if isinstance(value, str) and value.strip().lower() in words:
            return value.strip().lower()
        word = " or ".join(words)
        if isinstance(value, bool) or isinstance(value, float) and not value.is_integer():
            raise ConfigError(f"{name} must be a whole number or {word}, not {value!r}")
        try:
            return int(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ConfigError(f"{name} must be a whole number or {word}, not {value!r}") \
                from None
    if _kind(name) == "bool":  # TOML true/false, or a word from the env or command line
        if isinstance(value, bool):
            return value
        word = str(value).strip().lower()
        if word in ("true", "yes", "on", "1"):
            return True
        if word in ("false", "no", "off", "0"):
            return False
        raise ConfigError(f"{name} must be true or false, not {value!r}")
    if _kind(name) == "float":
        if isinstance(value, bool):
            raise ConfigError(f"{name} must be a number, not {value!r}")
        try:
            return float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ConfigError(f"{name} must be a number, not {value!r}") from None
    if _kind(name).startswith("dict"):  # a TOML table, or "a=b,c=d" from the env or command line
        return parse_table(name, value)
    if name == "gpus" and isinstance(value, (list, tuple)):  # TOML's gpus = [0, 1]
        value = ",".join(str(v) for v in value)
    if _kind(name).startswith("tuple"):  # a TOML list, or "a,b" from the env or command line
        if isinstance(value, str):
            value = [v for v in (part.strip() for part in value.split(",")) if v]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{name} must be a list of strings, not {value!r}")
        return tuple(value)
    if _kind(name) == "int":
        if isinstance(value, bool) or isinstance(value, float) and not value.is_integer():
            raise ConfigError(f"{name} must be a whole number, not {value!r}")
        try:
            return int(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ConfigError(f"{name} must be a whole number, not {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ConfigError(f"{name} must be text, not {value!r}")
    return str(value)


def check_setting(name: str, value: int | str) -> None:
    """The rules for one setting's value; ConfigError with the reason if it breaks one."""
    rules = _FIELDS[name].metadata
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if rules["least"] is not None and value < rules["least"]:
            raise ConfigError(f"{name} must be at least {rules['least']}, not {value}")
        if rules["most"] is not None and value > rules["most"]:
            raise ConfigError(f"{name} must be at most {rules['most']}, not {value}")
    if rules["words"] and value not in rules["words"]:
        raise ConfigError(f"{name} must be one of {', '.join(rules['words'])}, not {value!r}")
    if name == "host":
        try:
            paths.parse_host(str(value))
        except ValueError as e:
            raise ConfigError(f"host: {e}") from None
    elif name in ("keep_alive", "queue_timeout", "load_timeout"):
        parse_duration(str(value))
    elif name == "ram_budget":
        size = parse_size(str(value))
        if size is not None and size < 256 << 20:
            raise ConfigError(f"ram_budget must be auto or at least 256M, not {value!r}")
    elif name == "gpus":
        parse_gpus(str(value))
    elif name == "fill_bands":
        parse_bands(str(value))
    elif name == "socket" and value:
        if not os.path.isabs(str(value)):
            raise ConfigError(f"socket must be an absolute path, not {value!r}")
        if len(os.fsencode(str(value))) > _MAX_SOCKET_PATH:
            raise ConfigError(f"socket path is longer than {_MAX_SOCKET_PATH} bytes: {value}")
    elif name == "hf_endpoint" and not str(value).startswith(("http://", "https://")):
        raise ConfigError(f"hf_endpoint must start with http:// or https://, not {value!r}")
    elif name == "import_dirs":
        for directory in value:  # type: ignore[union-attr]
            if not os.path.isabs(os.path.expanduser(directory)):
                raise ConfigError(f"import_dirs: {directory!r} is not an absolute path")
    elif name == "rpc_workers":
        for endpoint in value:  # type: ignore[union-attr]
            try:
                parse_endpoint(endpoint)
            except ValueError as e:
                raise ConfigError(f"rpc_workers: {e}") from None


def validate(config: Config) -> None:
    for name, value in asdict(config).items():
        check_setting(name, value)


def _line_of(text: str, key: str) -> int | None:
    pattern = re.compile(rf"""^\s*(["']?){re.escape(key)}\1\s*=""")
    for number, line in enumerate(text.splitlines(), start=1):
        if pattern.match(line):
            return number
    return None


def parse_config(text: str, source: str = "config.toml") -> dict:
    """The settings a config file sets, checked one by one; errors carry the file and line."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        m = re.search(r"\(at line (\d+)", str(e))
        line = int(m.group(1)) if m else None
        reason = re.sub(r"\s*\(at line \d+, column \d+\)", "", str(e)) or str(e)
        where = f"{source}:{line}" if line else source
        raise ConfigError(f"{where}: {reason}", path=source, line=line, reason=reason) from None
    except RecursionError:
        reason = "values nested too deep to read"
        raise ConfigError(f"{source}: {reason}", path=source, reason=reason) from None
    values = {}
    for key, raw in doc.items():
        if key in CLIENT_TABLES and isinstance(raw, dict):
            continue  # read by the client that owns it, never by the daemon
        line = _line_of(text, key)
        where = f"{source}:{line}" if line else source
        try:
            values[key] = coerce(key, raw)
            check_setting(key, values[key])
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}", path=source, line=line, reason=str(e)) from None
    return values


def read_config_text(path: Path) -> str:
    """config.toml's text; ConfigError (with the place) when it is not UTF-8 or unreadable."""
    try:
        data = paths.read_regular(path)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it: {e.strerror or e}", path=str(path)) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        reason = f"not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start})"
        raise ConfigError(f"{path}:{line}: {reason}", path=str(path), line=line,
                          reason=reason) from None


def load_config_sources(path: Path | None = None,
                        environ: dict | None = None) -> tuple[Config, dict[str, str]]:
    """The effective config and where each value came from: 'default', 'file' or the env name."""
    path = path or config_file()
    environ = os.environ if environ is None else environ
    sources = dict.fromkeys(setting_names(), "default")
    values: dict = {}
    if path.is_file():
        values.update(parse_config(read_config_text(path), str(path)))
        sources.update(dict.fromkeys(values, "file"))
    for name, env in ENV.items():
        if not environ.get(env):
            continue
        try:
            values[name] = coerce(name, environ[env])
            check_setting(name, values[name])
        except ConfigError as e:
            raise ConfigError(f"environment {env}: {e}") from None
        sources[name] = env
    config = replace(Config(), **values)
    validate(config)
    return config, sources


def load_config(path: Path | None = None, environ: dict | None = None) -> Config:
    """Defaults < config file < environment. Raises ConfigError with the file and reason."""
    return load_config_sources(path, environ)[0]


def changed_settings(old: Config, new: Config) -> tuple[str, ...]:
    """Names of the settings whose values differ, in declaration order."""
    return tuple(n for n in setting_names() if getattr(old, n) != getattr(new, n))


def with_setting(text: str, name: str, value: int | str | tuple | None,
                 source: str = "config.toml") -> str:
    """config.toml's text with one setting set (or removed for None), comments kept.

    The value is checked first. The line that sets it is replaced in place so a user's comments
    and layout survive; when that cannot be done safely the file is written out again whole.
    """
    doc = tomllib.loads(text) if text.strip() else {}
    if value is not None:
        value = coerce(name, value)
        check_setting(name, value)
        if isinstance(value, tuple):
            value = list(value)  # as TOML reads it back
        doc[name] = value
    else:
        doc.pop(name, None)
    line = _line_of(text, name)
    lines = text.splitlines(keepends=True)
    if line is not None:
        replacement = [tomli_w.dumps({name: value})] if value is not None else []
        lines[line - 1:line] = replacement
    elif value is not None:
        if lines and not lines[-1].endswith("\n"):
            lines[-1] += "\n"
        # Top-level keys must come before any [table]; this file has none, so the end is safe.
        lines.append(tomli_w.dumps({name: value}))
    edited = "".join(lines)
    try:
        if tomllib.loads(edited) == doc:
            return edited
    except tomllib.TOMLDecodeError:
        pass
    return tomli_w.dumps(doc)
