"""The daemon's side of systemd's protocols, in plain socket code (no libsystemd binding).

- Socket activation (sd_listen_fds(3)): systemd binds the sockets and starts the service on the
  first connection, passing them as fds 3, 4, ... with LISTEN_FDS=n and LISTEN_PID=<our pid>.
- Readiness (sd_notify(3)): with Type=notify, "READY=1" sent to $NOTIFY_SOCKET tells systemd
  the service is up; "STOPPING=1" that it is shutting down.
- Journal (systemd.exec(5)): stderr connected to the journal is announced by
  JOURNAL_STREAM=<device>:<inode> of that stream.
"""

from __future__ import annotations

import os
import socket

SD_LISTEN_FDS_START = 3
_ACTIVATION_ENV = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")


def listen_fds(unset_environment: bool = True) -> list[socket.socket]:
    """The listening sockets systemd passed us, or [] when not socket-activated.

    The environment is cleared by default so that processes we start (model runners) do not
    take the sockets for theirs; the fds are made close-on-exec for the same reason.
    """
    try:
        pid = int(os.environ.get("LISTEN_PID", ""))
        count = int(os.environ.get("LISTEN_FDS", ""))
    except ValueError:
        return []
    finally:
        if unset_environment:
            for name in _ACTIVATION_ENV:
                os.environ.pop(name, None)
    if pid != os.getpid() or count <= 0:
        return []
    sockets = []
    for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + count):
        os.set_inheritable(fd, False)
        sockets.append(socket.socket(fileno=fd))  # family and type are read from the fd
    return sockets


def notify(message: str) -> bool:
    """Send a sd_notify message ("READY=1", "STOPPING=1", "STATUS=..."); False if not asked to."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        try:
            sock.connect(address)
            sock.sendall(message.encode())
        except OSError:
            return False
    return True


def journal_stream() -> bool:
    """True when stderr is the journal stream systemd gave us (not a redirect a child made)."""
    value = os.environ.get("JOURNAL_STREAM", "")
    device, _, inode = value.partition(":")
    if not device or not inode:
        return False
    try:
        stat = os.fstat(2)
    except OSError:
        return False
    return f"{stat.st_dev}:{stat.st_ino}" == value
