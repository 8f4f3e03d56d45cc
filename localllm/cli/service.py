"""`localllm service install|uninstall|status|logs|restart` and
`localllm config show|set|unset|edit`."""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from localllm.cli import user_service as us
from localllm.daemon.logging_setup import log_file

from localllm.config import (
    ENV,
    RESTART_NEEDED,
    ConfigError,
    config_file,
    load_config,
    load_config_sources,
    parse_config,
    read_config_text,
    setting_names,
    with_setting,
)
from localllm import paths
from localllm.errors import UserError
from localllm.paths import listen_address


def register(subparsers: argparse._SubParsersAction) -> None:
    service = subparsers.add_parser("service", help="run the daemon as a systemd user service")
    sub = service.add_subparsers(dest="service_command", metavar="ACTION", required=True)
    p = sub.add_parser("install", help="write the units and start listening (socket activation)")
    p.add_argument("--no-start", action="store_true",
                   help="only write the unit files; do not call systemctl")
    p.set_defaults(func=cmd_install)
    p = sub.add_parser("uninstall", help="stop the service and remove what install wrote")
    p.add_argument("--no-stop", action="store_true",
                   help="only remove the unit files; do not call systemctl")
    p.set_defaults(func=cmd_uninstall)
    sub.add_parser("status", help="whether the socket and the daemon are up").set_defaults(
        func=cmd_status)
    p = sub.add_parser("logs", help="show the daemon's log (the journal, or the log file)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    p.add_argument("-n", "--lines", type=int, default=50, help="how many lines (default 50)")
    p.set_defaults(func=cmd_logs)
    sub.add_parser("restart", help="restart the daemon (and rebind if host or socket changed)"
                   ).set_defaults(func=cmd_restart)

    config = subparsers.add_parser("config", help="show or change settings (config.toml)")
    sub = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    sub.add_parser("show", help="the settings in force and where each comes from").set_defaults(
        func=cmd_config_show)
    p = sub.add_parser("set", help="set one setting in config.toml")
    p.add_argument("key", help=", ".join(setting_names()))
    p.add_argument("value")
    p.set_defaults(func=cmd_config_set)
    p = sub.add_parser("unset", help="remove a setting from config.toml (back to its default)")
    p.add_argument("key")
    p.set_defaults(func=cmd_config_unset)
    sub.add_parser("edit", help="open config.toml in $EDITOR, then check it").set_defaults(
        func=cmd_config_edit)


# --- service -----------------------------------------------------------------------------------

def cmd_install(args: argparse.Namespace) -> int:
    if not args.no_start:
        us.require_systemd()  # before writing anything, so a failed install leaves nothing
    units = us.units_for(load_config())
    for path in us.write_units(units):
        print(f"wrote {path}")
    if args.no_start:
        print("not started (--no-start): run `systemctl --user daemon-reload && "
              f"systemctl --user enable --now {us.SOCKET}` to start listening")
        return 0
    us.start_units()
    listen = us.listen_addresses(load_config())
    print(f"listening on {listen.unix_path} and http://{listen.tcp}; "
          "the daemon starts on the first connection")
    print("to start it at boot, before you log in: loginctl enable-linger " + _user())
    return 0


def cmd_uninstall(args: argparse.Namespace) -> int:
    """Remove what install wrote, always; stop and disable the units where the user manager
    answers, and say so (exit 1) where it does not, so nothing is left half-known."""
    if us.read_manifest() is None:
        print("the localllm service is not installed: nothing to remove")
        return 0
    problem = None if args.no_stop else us.systemd_problem()
    if not args.no_stop and problem is None:
        result = us.systemctl("disable", "--now", us.SOCKET, us.SERVICE, check=False)
        if result.returncode != 0:
            problem = "systemctl --user disable --now failed: " + _first_line(result)
    for path in us.remove_units():
        print(f"removed {path}")
    if not args.no_stop and problem is None:
        result = us.systemctl("daemon-reload", check=False)
        if result.returncode != 0:
            problem = "systemctl --user daemon-reload failed: " + _first_line(result)
    if problem:
        raise UserError(f"removed the unit files, but could not stop or disable the units: "
                        f"{problem}; when the user manager is back, run `systemctl --user "
                        f"daemon-reload` (and `systemctl --user stop {us.SERVICE}` if it runs)")
    return 0


def _first_line(result) -> str:
    return (result.stderr.strip().splitlines() or [f"exit code {result.returncode}"])[0]


def cmd_status(args: argparse.Namespace) -> int:
    from localllm.client import running_daemon

    manifest = us.read_manifest()
    problem = us.systemd_problem() if manifest is not None else None
    if manifest is None or problem:
        # Asked only here: under systemd, a connection to its socket would start the service.
        daemon = asyncio.run(running_daemon(load_config()))
        if daemon is None:
            if problem:
                raise UserError(problem)
            raise UserError("the localllm service is not installed and no daemon is running: "
                            "`localllm serve` runs one in this terminal, `localllm service "
                            "install` sets up the systemd user service")
        print(f"a localllm daemon is running outside systemd: pid {daemon.pid}, since "
              f"{daemon.started_at}, on {daemon.where}")
        print("`localllm stop --daemon` stops it; " + (
            f"the service is installed, but {problem}" if problem else
            "`localllm service install` runs it as a systemd user service instead"))
        return 0
    states = us.service_state()
    listen = us.listen_addresses(load_config())
    for unit in (us.SOCKET, us.SERVICE):
        state = states.get(unit, {})
        line = f"{unit}: {state.get('ActiveState', 'unknown')} ({state.get('SubState', '?')})"
        if unit == us.SERVICE and state.get("MainPID", "0") != "0":
            line += f", pid {state['MainPID']}"
        elif unit == us.SERVICE and state.get("ActiveState") == "inactive":
            line += ", starts on the first connection"
        print(line)
    print(f"listening on: {listen.unix_path}, http://{listen.tcp}")
    print("unit files: " + ", ".join(manifest["files"]))
    if us.installed_units_changed(us.units_for(load_config())):
        print("settings changed since install: run `localllm service restart` to apply them")
    return 0


def cmd_restart(args: argparse.Namespace) -> int:
    if us.read_manifest() is None:
        raise UserError("the localllm service is not installed: run `localllm service install`")
    us.require_systemd()
    units = us.units_for(load_config())
    if us.installed_units_changed(units):
        us.write_units(units)
        us.start_units()
        print("units rewritten for the new settings; sockets rebound")
    us.systemctl("restart", us.SERVICE)
    print("localllm restarted")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    if us.read_manifest() is not None and us.systemd_problem() is None:
        command = ["journalctl", "--user", "-u", us.SERVICE, "-n", str(args.lines), "--no-pager"]
        if args.follow:
            command.append("-f")
        return subprocess.run(command).returncode
    path = log_file()
    if not path.is_file():
        raise UserError(f"no log yet: {path} does not exist (the daemon writes it when it runs "
                        "outside systemd)")
    with path.open("r", encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
        sys.stdout.writelines(lines[-args.lines:] if args.lines > 0 else [])
        sys.stdout.flush()
        if args.follow:
            _follow(path, f)
    return 0


def _follow(path: Path, f) -> None:
    """Print lines as they are appended, reopening the file when the log rotates."""
    inode = os.fstat(f.fileno()).st_ino
    while True:
        line = f.readline()
        if line:
            sys.stdout.write(line)
            sys.stdout.flush()
            continue
        try:
            if path.stat().st_ino != inode:
                f.close()
                f = path.open("r", encoding="utf-8", errors="replace")
                inode = os.fstat(f.fileno()).st_ino
                continue
        except FileNotFoundError:
            pass
        time.sleep(0.5)


def _user() -> str:
    import getpass

    return getpass.getuser()


# --- config ------------------------------------------------------------------------------------

def cmd_config_show(args: argparse.Namespace) -> int:
    path = config_file()
    config, sources = load_config_sources(path)
    print(f"# {path}{'' if path.is_file() else ' (not present: defaults)'}")
    width = max(map(len, setting_names()))
    for name in setting_names():
        value = getattr(config, name)
        if name == "api_key" and value:
            value = "(set, hidden)"
        elif name == "socket" and not value:
            value = f"{config.socket_path} (from the runtime dir)"
        elif name == "api_key":
            value = "(none)"
        elif isinstance(value, tuple):  # a list setting, as LOCALLLM_* takes it
            value = ",".join(value) or "(none)"
        source = sources[name]
        where = f"env {source}" if source in ENV.values() else source
        print(f"{name:<{width}}  {value!s:<42}  {where}")
    return 0


def _write_config(text: str) -> None:
    path = config_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    parse_config(text, str(path))  # never write what the daemon would reject
    paths.replace_private(path, text)  # 0600: it may hold api_key


def _current_text() -> str:
    path = config_file()
    text = read_config_text(path) if path.is_file() else ""
    parse_config(text, str(path))  # refuse to edit on top of a broken file by line
    return text


def cmd_config_set(args: argparse.Namespace) -> int:
    text = with_setting(_current_text(), args.key, args.value, str(config_file()))
    if args.key == "host":  # what the next `serve` would refuse is refused now
        listen_address(args.value, load_config().api_key)
    if args.key == "default_model":  # as `run` would answer it, every time
        _check_default_model(args.value)
    _write_config(text)
    value = getattr(load_config(config_file(), environ={}), args.key)
    shown = ",".join(value) if isinstance(value, tuple) else value
    print(f"{args.key} = {shown} (in {config_file()})")
    if args.key in RESTART_NEEDED:
        print(f"a running daemon takes the new {args.key} when restarted "
              "(`localllm service restart`, or restart `localllm serve`)")
    _warn_env_override(args.key)
    return 0


def _check_default_model(name: str) -> None:
    from localllm.cli.suggest import known_model, nearest_names

    if known_model(name):
        return
    close = nearest_names(name)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    raise UserError(f"no model '{name}' is stored or in the catalog, so `localllm run` could "
                    f"not use it; {hint}(`localllm list` shows stored models, `localllm pull "
                    "--list` the catalog)")


def cmd_config_unset(args: argparse.Namespace) -> int:
    if args.key not in ENV:
        raise ConfigError(f"unknown setting {args.key!r} (known: {', '.join(setting_names())})")
    _write_config(with_setting(_current_text(), args.key, None, str(config_file())))
    print(f"{args.key} removed from {config_file()}: the default applies")
    _warn_env_override(args.key)
    return 0


def _warn_env_override(key: str) -> None:
    env = ENV[key]
    if os.environ.get(env):
        print(f"note: {env} is set in this environment and overrides the file", file=sys.stderr)


def cmd_config_edit(args: argparse.Namespace) -> int:
    path = config_file()
    original = read_config_text(path) if path.is_file() else ""
    editor = shlex.split(os.environ.get("VISUAL") or os.environ.get("EDITOR") or "vi")
    with tempfile.TemporaryDirectory(prefix="localllm-config-") as tmp:
        draft = Path(tmp) / "config.toml"  # same name, so editors pick TOML highlighting
        draft.write_text(original)
        while True:
            try:
                code = subprocess.run([*editor, str(draft)]).returncode
            except FileNotFoundError:
                raise UserError(f"editor {editor[0]!r} not found: set $EDITOR") from None
            if code != 0:
                raise UserError(f"the editor exited with code {code}; {path} is unchanged")
            text = draft.read_text()
            try:
                parse_config(text, str(path))
                break
            except ConfigError as e:
                if not (sys.stdin.isatty() and _ask(f"{e}\nedit again? [Y/n] ")):
                    raise UserError(f"{e} ({path} is unchanged)") from None
    if text == original:
        print(f"{path} unchanged")
        return 0
    _write_config(text)
    print(f"saved {path}; a running daemon applies it now")
    return 0


def _ask(prompt: str) -> bool:
    return input(prompt).strip().lower() in ("", "y", "yes")
