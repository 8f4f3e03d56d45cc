"""RPC workers as the planner sees them: endpoints, what a worker offers, and the probe that
measures one (run in a child process: llama/rpc.py owns the ggml-rpc library).

ggml-rpc aborts the whole process when a worker cannot be reached, so every use of the library
is preceded by `check_reachable`, ggml-rpc's HELLO spoken from Python.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import struct
import subprocess
import sys
from dataclasses import asdict, dataclass

from localllm import config_values
from localllm.errors import UserError

PROBE_TIMEOUT_S = 60.0
RPC_CMD_HELLO, HELLO_CAPS = 14, 24  # ggml-rpc.cpp: the HELLO command, RPC_CONN_CAPS_SIZE
RPC_PROTO_MAJOR = 7  # ggml-rpc.h of the vendored llama.cpp
CONNECT_TIMEOUT_S = 3.0


class WorkerError(UserError):
    """A worker that cannot be used: unreachable, busy, or a bad endpoint."""


@dataclass(frozen=True)
class WorkerDevice:
    endpoint: str  # "host:port"
    index: int  # device number on that worker
    free_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class Worker:
    endpoint: str
    devices: tuple[WorkerDevice, ...]
    link_bytes_per_s: float  # measured: the slower of upload and download
    rtt_s: float  # measured: one command's round trip
    compute_bytes_per_s: float = 0.0  # measured: Q4_0 weights its device reads a second in a
    # matrix-vector chain (decode's work); 0 when it could not be measured

    @property
    def free_bytes(self) -> int:
        return sum(d.free_bytes for d in self.devices)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Worker:
        return cls(data["endpoint"], tuple(WorkerDevice(**d) for d in data["devices"]),
                   float(data["link_bytes_per_s"]), float(data["rtt_s"]),
                   float(data.get("compute_bytes_per_s", 0.0)))


# ---- endpoints ---------------------------------------------------------------------------------

def parse_endpoint(text: str) -> tuple[str, int]:
    """"host:port" -> (host, port); WorkerError says what is wrong."""
    try:
        return config_values.parse_endpoint(text)
    except ValueError as e:
        raise WorkerError(str(e)) from None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_reachable(endpoint: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """ggml-rpc's HELLO from Python, so that llama.cpp never aborts on a worker that is not
    there or speaks another protocol, and never waits on one that serves someone else."""
    host, port = parse_endpoint(endpoint)
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            # cmd byte, request size (uint64), the request: transport capabilities, none here
            s.sendall(struct.pack("<BQ", RPC_CMD_HELLO, HELLO_CAPS) + bytes(HELLO_CAPS))
            answer = b""
            while len(answer) < 8 + 4:
                part = s.recv(64)
                if not part:
                    break
                answer += part
    except TimeoutError:
        raise WorkerError(f"RPC worker {endpoint} accepted the connection but did not answer "
                          f"within {timeout:.0f} s: a worker serves one client at a time; is "
                          f"another model or program using it?") from None
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise WorkerError(f"cannot reach RPC worker {endpoint} ({reason}); start "
                          f"`localllm worker` there or fix rpc_workers") from None
    if len(answer) < 12:
        raise WorkerError(f"{endpoint} closed the connection at the RPC handshake: is it a "
                          f"`localllm worker` of the same version?")
    major, minor, patch = answer[8], answer[9], answer[10]
    if major != RPC_PROTO_MAJOR:
        raise WorkerError(f"RPC worker {endpoint} speaks protocol {major}.{minor}.{patch}, this "
                          f"build {RPC_PROTO_MAJOR}.x: run the same localllm version on both")


def probe_workers(endpoints: list[str] | tuple[str, ...],
                  timeout: float = PROBE_TIMEOUT_S) -> list[Worker]:
    """Memory and link of each worker, measured from a child process (see the module doc)."""
    endpoints = list(endpoints)
    for endpoint in endpoints:
        check_reachable(endpoint)
    try:
        done = subprocess.run([sys.executable, "-m", "localllm.llama.rpc", *endpoints],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise WorkerError(
            f"RPC workers {', '.join(endpoints)} did not answer within {timeout:.0f} s; a "
            f"worker serves one client at a time: is another model or program using it?"
        ) from None
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise WorkerError(f"probing RPC workers {', '.join(endpoints)} failed: {tail}")
    answer = json.loads(lines[-1])
    if "error" in answer:
        raise WorkerError(answer["error"])
    return [Worker.from_dict(w) for w in answer["workers"]]
