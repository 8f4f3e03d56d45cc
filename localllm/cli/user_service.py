"""The systemd user service: unit files, install and uninstall, and the record of what was written.

Two units in `$XDG_CONFIG_HOME/systemd/user/` (default `~/.config/systemd/user/`):
- localllm.socket: systemd listens on the Unix socket and the HTTP address and starts the
  daemon on the first connection, handing it the sockets (see systemd.listen_fds);
- localllm.service: runs `localllm serve` and restarts it when it fails.

install records every file and folder it created in a manifest in the state dir, and uninstall
removes exactly those, so a config dir goes back to what it was.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from localllm import paths
from localllm.client import serve_command
from localllm.config import Config
from localllm.errors import UserError

SERVICE = "localllm.service"
SOCKET = "localllm.socket"
# What the daemon must see to use the same dirs and engine as the shell that installed it; the
# user manager's environment often lacks variables a login shell sets. LOCALLLM_* settings
# are left out on purpose: the service's settings live in config.toml.
PASSED_ENV = ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME",
              "LOCALLLM_MODELS", "LLAMA_CPP_LIB_PATH")
NO_SYSTEMD_HINT = "run `localllm serve` in a terminal instead"


@dataclass(frozen=True)
class Listen:
    """Where the socket unit listens: a Unix socket path and a numeric TCP address."""

    unix_path: str
    tcp: str  # "127.0.0.1:11435" or "[::1]:11435", as ListenStream= takes it


def unit_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "systemd" / "user"


def manifest_path() -> Path:
    return paths.state_dir() / "service-install.json"


def _quote(arg: str, in_exec: bool = True) -> str:
    """One word of a unit setting. systemd expands '%' specifiers everywhere and '$VARIABLES'
    on Exec lines only, so those are doubled to stay literal."""
    arg = arg.replace("%", "%%")
    if in_exec:
        arg = arg.replace("$", "$$")
    if arg and not any(c in arg for c in ' \t"\'\\'):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_units(command: list[str], listen: Listen, environment: dict[str, str]) -> dict[str, str]:
    """The text of both units; pure, so tests and `systemd-analyze verify` can check it."""
    env_lines = "".join(f"Environment={_quote(f'{k}={v}', in_exec=False)}\n"
                        for k, v in sorted(environment.items()))
    header = "# Written by `localllm service install`; `localllm service uninstall` removes it.\n"
    service = f"""{header}[Unit]
Description=localllm: local LLM service
Requires={SOCKET}
After={SOCKET}

[Service]
Type=notify
NotifyAccess=main
ExecStart={" ".join(_quote(a) for a in command)}
{env_lines}Restart=on-failure
RestartSec=2s
# SIGTERM goes to the daemon, which stops its model runners; what is left is killed after this.
KillMode=mixed
TimeoutStopSec=30s
# When memory runs out, lose the model server before the desktop session.
OOMScoreAdjust=200
UMask=0077
# Sandboxing that works in a user manager and keeps the GPU usable. Not used: PrivateDevices
# (hides /dev/nvidia*), MemoryDenyWriteExecute (CUDA's JIT and libffi need writable code),
# ProtectSystem/ProtectHome (need user namespaces in a user manager, and the model store may
# live anywhere LOCALLLM_MODELS points).
NoNewPrivileges=yes
LockPersonality=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
RestrictNamespaces=yes
SystemCallArchitectures=native
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK
"""
    sock = f"""{header}[Unit]
Description=localllm sockets (the daemon starts on the first connection)

[Socket]
ListenStream={listen.unix_path}
ListenStream={listen.tcp}
SocketMode=0600
DirectoryMode=0700
RemoveOnStop=yes

[Install]
WantedBy=sockets.target
"""
    return {SERVICE: service, SOCKET: sock}


def listen_addresses(config: Config) -> Listen:
    unix_path = str(config.socket_path)
    if len(os.fsencode(unix_path)) > 107:
        raise UserError(f"socket path is too long for a Unix socket (over 107 bytes): {unix_path};"
                        " set a shorter one with `localllm config set socket PATH`")
    host, port = config.tcp
    try:
        family, *_, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise UserError(f"cannot resolve host {host!r} for the socket unit: {e}") from None
    numeric = f"[{address[0]}]:{port}" if family == socket.AF_INET6 else f"{address[0]}:{port}"
    return Listen(unix_path=unix_path, tcp=numeric)


def units_for(config: Config) -> dict[str, str]:
    environment = {k: os.environ[k] for k in PASSED_ENV if os.environ.get(k)}
    return render_units(serve_command(), listen_addresses(config), environment)


# --- systemctl ---------------------------------------------------------------------------------

def systemd_problem() -> str | None:
    """Why the systemd user manager cannot be used here, or None when it can."""
    if shutil.which("systemctl") is None:
        return f"systemd is not available here (no systemctl); {NO_SYSTEMD_HINT}"
    result = subprocess.run(["systemctl", "--user", "show-environment"], capture_output=True,
                            text=True)
    if result.returncode != 0:
        why = (result.stderr.strip().splitlines() or ["no answer"])[0]
        return f"the systemd user manager is not reachable ({why}); {NO_SYSTEMD_HINT}"
    return None


def require_systemd() -> None:
    problem = systemd_problem()
    if problem:
        raise UserError(problem)


def systemctl(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["systemctl", "--user", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        why = (result.stderr.strip().splitlines() or [f"exit code {result.returncode}"])[0]
        raise UserError(f"systemctl --user {' '.join(args)} failed: {why}")
    return result


# --- install / uninstall -----------------------------------------------------------------------

def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def read_manifest() -> dict | None:
    try:
        return json.loads(manifest_path().read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {manifest_path()}: {e}") from None


def _write_manifest(manifest: dict) -> None:
    path = manifest_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(path)


def _missing_dirs(path: Path) -> list[Path]:
    """path and its ancestors that do not exist yet, outermost first."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    return missing[::-1]


def _write_file(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_units(units: dict[str, str]) -> list[Path]:
    """Write the units (refusing to overwrite files localllm did not write) and record them."""
    manifest = read_manifest() or {"files": {}, "created_dirs": []}
    directory = unit_dir()
    for name in units:
        target = directory / name
        if target.exists() and str(target) not in manifest["files"]:
            raise UserError(f"{target} exists and was not written by localllm; "
                            "move it away first")
    created = [str(d) for d in _missing_dirs(directory)]
    manifest["created_dirs"] += [d for d in created if d not in manifest["created_dirs"]]
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in units.items():
        target = directory / name
        manifest["files"][str(target)] = _sha256(text)
        _write_manifest(manifest)  # recorded before written: an interrupted install can be undone
        _write_file(target, text)
        written.append(target)
    return written


def wants_dir() -> Path:
    return unit_dir() / "sockets.target.wants"


def record_created_dirs(dirs: list[Path]) -> None:
    manifest = read_manifest() or {"files": {}, "created_dirs": []}
    manifest["created_dirs"] += [str(d) for d in dirs if str(d) not in manifest["created_dirs"]]
    _write_manifest(manifest)


def start_units() -> None:
    """Reload, and (re)start listening. The service is stopped first: systemd refuses to start
    a socket whose service is running, and a running daemon would keep the old command line."""
    missing_wants = _missing_dirs(wants_dir())
    systemctl("daemon-reload")
    systemctl("stop", SERVICE)
    systemctl("enable", SOCKET)
    record_created_dirs(missing_wants)
    systemctl("restart", SOCKET)


def remove_units() -> list[Path]:
    """Remove what the manifest lists; folders only when install created them and they are empty.

    Returns the files removed. The enable symlink is removed here too, so that an uninstall
    without systemctl leaves no dangling link.
    """
    manifest = read_manifest()
    if manifest is None:
        return []
    link = wants_dir() / SOCKET
    ours = {Path(name).resolve() for name in manifest["files"]}
    if link.is_symlink() and (link.parent / os.readlink(link)).resolve() in ours:
        link.unlink()
    removed = []
    for name in manifest["files"]:
        path = Path(name)
        if path.exists():
            path.unlink()
            removed.append(path)
    for name in sorted(manifest["created_dirs"], key=len, reverse=True):
        try:
            Path(name).rmdir()
        except FileNotFoundError:
            pass
        except OSError:  # not empty: something else lives there now
            pass
    manifest_path().unlink()
    return removed


def installed_units_changed(units: dict[str, str]) -> bool:
    directory = unit_dir()
    for name, text in units.items():
        path = directory / name
        if not path.is_file() or path.read_text() != text:
            return True
    return False


def service_state() -> dict[str, dict[str, str]]:
    """ActiveState, SubState and MainPID of both units, from `systemctl --user show`."""
    result = systemctl("show", "--property=Id,ActiveState,SubState,MainPID,Listen", SOCKET,
                       SERVICE)
    states: dict[str, dict[str, str]] = {}
    for block in result.stdout.strip().split("\n\n"):
        props = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        states[props.get("Id", "")] = props
    return states
