"""`localllm service ...`: install writes the units and a record of them, uninstall puts the config
dir back byte for byte; without systemd every command says so in one line and exits 1.

systemctl itself is not run here (no user manager in a container or CI): install --no-start and
uninstall --no-stop do all the file work for real and skip only the systemctl calls.
"""

from __future__ import annotations

import os
import pty
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from localllm.cli import user_service as us
from localllm.cli.main import main
from localllm.daemon.logging_setup import log_file

from localllm.config import Config


def _snapshot(root: Path) -> dict[str, tuple]:
    """Every path under root with its kind, mode and bytes (or link target)."""
    tree = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        if path.is_symlink():
            tree[str(path)] = ("link", os.readlink(path))
        elif path.is_dir():
            tree[str(path)] = ("dir", st.st_mode)
        else:
            tree[str(path)] = ("file", st.st_mode, path.read_bytes())
    return tree


@pytest.mark.parametrize("systemd_dir_existed", [False, True])
def test_install_then_uninstall_leaves_the_config_dir_as_it_was(home, capsys,
                                                                systemd_dir_existed):
    config_home = Path(os.environ["XDG_CONFIG_HOME"])
    (config_home / "localllm").mkdir()
    (config_home / "localllm" / "config.toml").write_text("max_queue = 4  # mine\n")
    if systemd_dir_existed:
        other = config_home / "systemd" / "user" / "other.service"
        other.parent.mkdir(parents=True)
        other.write_text("[Service]\nExecStart=/bin/true\n")
    before = _snapshot(config_home)

    assert main(["service", "install", "--no-start"]) == 0
    unit_dir = config_home / "systemd" / "user"
    service = (unit_dir / us.SERVICE).read_text()
    sock = (unit_dir / us.SOCKET).read_text()
    assert "ExecStart=" in service and " serve\n" in service and "Restart=on-failure" in service
    assert "PrivateDevices" not in service.replace("Not used: PrivateDevices", "")
    assert f"Environment=XDG_CONFIG_HOME={config_home}\n" in service
    assert f"ListenStream={Path(os.environ['XDG_RUNTIME_DIR'])}/localllm/localllm.sock\n" in sock
    assert "ListenStream=127.0.0.1:11435\n" in sock
    assert f"wrote {unit_dir / us.SERVICE}" in capsys.readouterr().out

    # systemctl enable's symlink, made by hand here, is removed too when it points at our unit.
    wants = unit_dir / "sockets.target.wants"
    us.record_created_dirs([wants])
    wants.mkdir()
    (wants / us.SOCKET).symlink_to(unit_dir / us.SOCKET)

    assert main(["service", "uninstall", "--no-stop"]) == 0
    assert _snapshot(config_home) == before
    assert not us.manifest_path().exists()
    assert main(["service", "uninstall", "--no-stop"]) == 0  # twice is harmless
    assert "not installed" in capsys.readouterr().out


def test_install_refuses_to_overwrite_a_unit_it_did_not_write(home, capsys):
    unit = us.unit_dir() / us.SERVICE
    unit.parent.mkdir(parents=True)
    unit.write_text("[Service]\nExecStart=/usr/bin/someone-elses\n")
    assert main(["service", "install", "--no-start"]) == 1
    assert "was not written by localllm" in capsys.readouterr().err
    assert unit.read_text() == "[Service]\nExecStart=/usr/bin/someone-elses\n"
    assert not (us.unit_dir() / us.SOCKET).exists()


def test_reinstall_with_new_settings_rewrites_the_units(home):
    assert main(["service", "install", "--no-start"]) == 0
    assert main(["config", "set", "host", "127.0.0.1:12001"]) == 0
    units = us.units_for(Config(host="127.0.0.1:12001"))
    assert us.installed_units_changed(units)
    assert main(["service", "install", "--no-start"]) == 0
    assert "ListenStream=127.0.0.1:12001\n" in (us.unit_dir() / us.SOCKET).read_text()
    assert not us.installed_units_changed(units)


@pytest.mark.parametrize("command", [["install"], ["uninstall"], ["status"], ["restart"]])
def test_without_systemd_each_command_says_so_in_one_line(home, tmp_path, command):
    # A real run of the command where there is no systemctl on PATH (containers, macOS).
    if command != ["install"]:
        assert main(["service", "install", "--no-start"]) == 0
    empty_bin = tmp_path / "empty-bin"
    empty_bin.mkdir()
    # A port no daemon listens on: `status` asks whether one runs outside systemd, and a daemon
    # of the user's own on the default port would answer.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{probe.getsockname()[1]}"
    result = subprocess.run([sys.executable, "-m", "localllm.cli", "service", *command],
                            env={**os.environ, "PATH": str(empty_bin), "LOCALLLM_HOST": nobody},
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "systemd is not available here" in result.stderr
    assert "localllm serve" in result.stderr
    if command == ["install"]:
        assert not us.unit_dir().exists()  # refused before writing anything
    if command == ["uninstall"]:  # what install wrote goes anyway; what it could not do is said
        assert "removed the unit files" in result.stderr
        assert not (us.unit_dir() / us.SERVICE).exists() and not us.manifest_path().exists()


def test_uninstall_when_the_user_manager_is_not_reachable_removes_what_install_wrote(home,
                                                                                    tmp_path):
    if not shutil.which("systemctl"):
        pytest.fail("systemctl is needed (scripts/test.sh installs systemd)")
    before = _snapshot(Path(os.environ["XDG_CONFIG_HOME"]))
    assert main(["service", "install", "--no-start"]) == 0
    # A real systemctl with no user bus to talk to (an ssh session without lingering).
    env = {**os.environ, "DBUS_SESSION_BUS_ADDRESS": f"unix:path={tmp_path}/no-bus",
           "XDG_RUNTIME_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "localllm.cli", "service", "uninstall"],
                            env=env, capture_output=True, text=True)
    assert result.returncode == 1, result
    assert f"removed {us.unit_dir() / us.SERVICE}" in result.stdout
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "user manager is not reachable" in result.stderr
    assert "removed the unit files, but could not stop or disable" in result.stderr
    assert _snapshot(Path(os.environ["XDG_CONFIG_HOME"])) == before
    assert not us.manifest_path().exists()


def test_service_logs_shows_the_log_file_without_systemd(home, capsys):
    program = (
        "import logging\n"
        "from localllm.config import Config\n"
        "from localllm.daemon.logging_setup import setup_logging\n"
        "setup_logging(Config())\n"
        "logging.getLogger('localllm.test').info('model loaded', extra={'model': 'smollm2'})\n"
        "logging.getLogger('localllm.test').debug('not at info')\n"
        "logging.getLogger('localllm.test').warning('slow disk')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
    terminal, stderr = pty.openpty()
    try:
        subprocess.run([sys.executable, "-c", program], env=env, stderr=stderr, check=True)
        seen = os.read(terminal, 1 << 16).decode()
    finally:
        os.close(terminal)
        os.close(stderr)
    assert "msg=\"slow disk\"" in seen  # a terminal running `localllm serve` sees it
    piped = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True,
                           text=True, check=True)
    assert "msg=\"slow disk\"" in piped.stderr  # a pipe (a container's log) sees it too
    from localllm.client import daemon_log_path

    daemon_log_path().parent.mkdir(parents=True, exist_ok=True)
    with open(daemon_log_path(), "w") as background:  # where a background start sends stderr
        subprocess.run([sys.executable, "-c", program], env=env, stderr=background, check=True)
    assert daemon_log_path().read_text() == ""  # ... repeats nothing of localllm.log
    assert main(["service", "logs", "-n", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("ts=")
    assert "level=info logger=localllm.test msg=\"model loaded\" model=smollm2" in lines[0]
    assert lines[1].endswith("level=warning logger=localllm.test msg=\"slow disk\"")


def test_service_logs_without_a_log_says_where_it_would_be(home, capsys):
    assert main(["service", "logs"]) == 1
    assert f"no log yet: {log_file()}" in capsys.readouterr().err


def test_under_the_journal_lines_carry_syslog_priorities(home, tmp_path):
    program = (
        "import logging\n"
        "from localllm.config import Config\n"
        "from localllm.daemon.logging_setup import setup_logging\n"
        "setup_logging(Config(log_level='debug'))\n"
        "log = logging.getLogger('localllm.daemon')\n"
        "log.debug('probe', extra={'card': 'rtx 3060'})\n"
        "log.error('load failed')\n"
        "try:\n    1 / 0\nexcept ZeroDivisionError:\n    log.exception('boom')\n"
    )
    journal = tmp_path / "journal"
    with journal.open("w") as err:
        st = os.fstat(err.fileno())
        env = {**os.environ, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        subprocess.run([sys.executable, "-c", program], env=env, stderr=err, check=True)
    lines = journal.read_text().splitlines()
    assert lines[0] == '<7>level=debug logger=localllm.daemon msg=probe card="rtx 3060"'
    assert lines[1] == "<3>level=error logger=localllm.daemon msg=\"load failed\""
    assert lines[2] == "<3>level=error logger=localllm.daemon msg=boom"
    assert all(line.startswith("<3>") for line in lines[3:]) and "ZeroDivisionError" in lines[-1]
    assert not log_file().exists()  # under systemd the journal is the log


def test_the_daemon_is_the_installed_command_beside_this_python():
    """A unit's ExecStart and a client's background start run the console script the install
    put beside the interpreter (what `localllm serve` is), whatever PATH holds."""
    found = subprocess.run(
        [sys.executable, "-c", "from localllm.client import serve_command; "
                               "print(*serve_command(), sep='\\n')"],
        env={**os.environ, "PATH": ""}, capture_output=True, text=True, check=True)
    assert found.stdout.splitlines() == [str(Path(sys.executable).parent / "localllm"), "serve"]


def test_without_the_installed_command_starting_the_daemon_says_to_install(tmp_path,
                                                                           monkeypatch):
    from localllm.client import serve_command
    from localllm.errors import UserError

    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setattr(sys, "argv", ["pytest"])
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(UserError, match="`localllm` command is not installed beside .*python"):
        serve_command()
