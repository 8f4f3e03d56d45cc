"""llama.cpp's RPC backend (libggml-rpc) through ctypes: lend this machine's device to others
(`localllm worker`), measure a worker (memory, link), and give workers to a model load.

Facts about this version of ggml-rpc that shape the code:
- A worker serves one client at a time; a second client waits until the first disconnects.
  A probe therefore runs in a child that exits when done, and waits with a deadline.
- The client aborts the whole process (GGML_ABORT) when a worker cannot be reached, so every
  call into the library is preceded by a plain TCP check, and probes run in a child process.
- The devices of a worker are named RPC0, RPC1... in the order servers were added, and the
  library has no way to forget a server: a runner (one model, one process) adds them once.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import struct
import sys
import time
from functools import lru_cache

from localllm.engine.probes import Worker, WorkerDevice, WorkerError, Workers

from localllm import config_values
from localllm.paths import is_loopback

DEVICE_CPU, DEVICE_GPU = 0, 1
GGML_TYPE_F32, GGML_TYPE_Q4_0, GGML_TYPE_I8 = 0, 2, 24
COMPUTE_MATRIX_ROWS = 16384  # a 16384 x 16384 Q4_0 matrix: 144 MiB, as big as a 27B block
LINK_SAMPLE_BYTES = 8 << 20  # below ggml-rpc's 10 MiB threshold for hashed (cached) uploads
RPC_CMD_HELLO, HELLO_CAPS = 14, 24  # ggml-rpc.cpp: the HELLO command, RPC_CONN_CAPS_SIZE
RPC_PROTO_MAJOR = 7  # ggml-rpc.h of the vendored llama.cpp
CONNECT_TIMEOUT_S = 3.0


def check_reachable(endpoint: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """ggml-rpc's HELLO from Python, so that llama.cpp never aborts on a worker that is not
    there or speaks another protocol, and never waits on one that serves someone else."""
    try:
        host, port = config_values.parse_endpoint(endpoint)
    except ValueError as e:
        raise WorkerError(str(e)) from None
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


# ---- the libraries ----------------------------------------------------------------------------

@lru_cache(maxsize=1)
def _libs():
    """(libggml: device registry, libggml-base: buffers and tensors, libggml-rpc) beside the
    libllama that llama_cpp loaded."""
    import llama_cpp.llama_cpp as llama_lib

    directory = os.path.dirname(llama_lib._lib._name)
    path = os.path.join(directory, "libggml-rpc.so")
    if not os.path.isfile(path):
        raise WorkerError("this llama.cpp build has no RPC backend (libggml-rpc.so); reinstall "
                          "with scripts/install.sh, which builds it with -DGGML_RPC=on")
    reg = ctypes.CDLL(os.path.join(directory, "libggml.so"))
    base = ctypes.CDLL(os.path.join(directory, "libggml-base.so"))
    rpc = ctypes.CDLL(path)
    p, sz, s = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
    for lib, name, args, ret in (
        (reg, "ggml_backend_dev_count", [], sz),
        (reg, "ggml_backend_dev_get", [sz], p),
        (reg, "ggml_backend_dev_by_name", [s], p),
        (reg, "ggml_backend_dev_by_type", [ctypes.c_int], p),
        (base, "ggml_backend_dev_name", [p], s),
        (base, "ggml_backend_dev_description", [p], s),
        (base, "ggml_backend_dev_type", [p], ctypes.c_int),
        (base, "ggml_backend_dev_memory", [p, ctypes.POINTER(sz), ctypes.POINTER(sz)], None),
        (base, "ggml_backend_reg_dev_count", [p], sz),
        (base, "ggml_backend_reg_dev_get", [p, sz], p),
        (base, "ggml_init", [_InitParams], p),
        (base, "ggml_free", [p], None),
        (base, "ggml_new_tensor_1d", [p, ctypes.c_int, ctypes.c_int64], p),
        (base, "ggml_new_tensor_2d", [p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64], p),
        (base, "ggml_mul_mat", [p, p, p], p),
        (base, "ggml_new_graph", [p], p),
        (base, "ggml_build_forward_expand", [p, p], None),
        (base, "ggml_backend_buffer_clear", [p, ctypes.c_uint8], None),
        (base, "ggml_backend_graph_compute", [p, p], ctypes.c_int),
        (base, "ggml_backend_free", [p], None),
        (base, "ggml_backend_alloc_ctx_tensors_from_buft", [p, p], p),
        (base, "ggml_backend_buffer_free", [p], None),
        (base, "ggml_backend_tensor_set", [p, p, sz, sz], None),
        (base, "ggml_backend_tensor_get", [p, p, sz, sz], None),
        (rpc, "ggml_backend_rpc_add_server", [s], p),
        (rpc, "ggml_backend_rpc_init", [s, ctypes.c_uint32], p),
        (rpc, "ggml_backend_rpc_buffer_type", [s, ctypes.c_uint32], p),
        (rpc, "ggml_backend_rpc_get_device_memory",
         [s, ctypes.c_uint32, ctypes.POINTER(sz), ctypes.POINTER(sz)], None),
        (rpc, "ggml_backend_rpc_start_server", [s, s, sz, sz, ctypes.POINTER(p)], None),
    ):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ret
    return reg, base, rpc


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p),
                ("no_alloc", ctypes.c_bool)]


def local_devices() -> list[tuple[str, str, int]]:
    """(name, description, total bytes) of this build's devices: what `--device` may name."""
    reg, base, _ = _libs()
    out = []
    for i in range(reg.ggml_backend_dev_count()):
        dev = reg.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        base.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        out.append((base.ggml_backend_dev_name(dev).decode(),
                    base.ggml_backend_dev_description(dev).decode(), total.value))
    return out


# ---- the worker side --------------------------------------------------------------------------

NO_AUTH_WARNING = """
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
WARNING: Host ('{host}') is != '127.0.0.1'
         Never expose the RPC server to an open network!
         This is an experimental feature and is not secure!
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
"""


def serve(host: str, port: int, device_names: list[str], threads: int) -> int:
    """Serve devices of this machine to llama.cpp clients until killed (llama.cpp's
    rpc-server, from the same build as the runner). Returns only on a failure."""
    import llama_cpp  # noqa: F401  (loads the ggml libraries and registers the devices)

    reg, base, rpc = _libs()
    if device_names:
        devices = []
        for name in device_names:
            dev = reg.ggml_backend_dev_by_name(name.encode())
            if not dev:
                known = ", ".join(n for n, _, _ in local_devices())
                raise WorkerError(f"no device {name!r} in this llama.cpp build; known: {known}")
            devices.append(dev)
    else:  # as rpc-server: the accelerators, else the CPU
        devices = [reg.ggml_backend_dev_get(i) for i in range(reg.ggml_backend_dev_count())
                   if base.ggml_backend_dev_type(reg.ggml_backend_dev_get(i)) == DEVICE_GPU]
        devices = devices or [reg.ggml_backend_dev_by_type(DEVICE_CPU)]
    # Bind once ourselves: a port in use is then a clear error, not llama.cpp's one line.
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise WorkerError(f"cannot listen on {host}:{port} ({e.strerror}); pick another "
                          f"--port or stop what uses it") from None
    if not is_loopback(host):
        print(NO_AUTH_WARNING.format(host=host), file=sys.stderr, flush=True)
    names = ", ".join(base.ggml_backend_dev_name(d).decode() for d in devices)
    print(f"localllm worker: serving {names} on {host}:{port} ({threads} threads); "
          f"Ctrl-C stops it", flush=True)
    array = (ctypes.c_void_p * len(devices))(*devices)
    # The server loop never returns to Python: let the default handlers end the process.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    rpc.ggml_backend_rpc_start_server(f"{host}:{port}".encode(), None, threads, len(devices),
                                      array)
    raise WorkerError(f"the RPC server on {host}:{port} stopped (see the lines above)")


# ---- the client side: probing -----------------------------------------------------------------

def _memory(rpc, endpoint: bytes, index: int) -> tuple[int, int]:
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    rpc.ggml_backend_rpc_get_device_memory(endpoint, index, ctypes.byref(free),
                                           ctypes.byref(total))
    return free.value, total.value


def _measure_link(endpoint: str, rounds: int = 3) -> tuple[float, float]:
    """(bytes/s, round-trip seconds) to a worker: a sample tensor uploaded and read back.

    An upload has no reply, so each one is followed by a memory query (one round trip, which
    the worker answers only after the upload): upload time = that pair minus a lone query."""
    _, base, rpc = _libs()
    ep = endpoint.encode()
    ctx = base.ggml_init(_InitParams(1 << 16, None, True))
    tensor = base.ggml_new_tensor_1d(ctx, GGML_TYPE_I8, LINK_SAMPLE_BYTES)
    buffer = base.ggml_backend_alloc_ctx_tensors_from_buft(
        ctx, rpc.ggml_backend_rpc_buffer_type(ep, 0))
    if not buffer:
        base.ggml_free(ctx)
        raise WorkerError(f"RPC worker {endpoint} could not allocate a "
                          f"{LINK_SAMPLE_BYTES >> 20} MiB test buffer")
    data = ctypes.create_string_buffer(os.urandom(LINK_SAMPLE_BYTES), LINK_SAMPLE_BYTES)
    try:
        pings = []
        for _ in range(5):
            t0 = time.perf_counter()
            _memory(rpc, ep, 0)
            pings.append(time.perf_counter() - t0)
        rtt = sorted(pings)[len(pings) // 2]
        up, down = [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            base.ggml_backend_tensor_set(tensor, data, 0, LINK_SAMPLE_BYTES)
            _memory(rpc, ep, 0)
            up.append(time.perf_counter() - t0 - rtt)
            t0 = time.perf_counter()
            base.ggml_backend_tensor_get(tensor, data, 0, LINK_SAMPLE_BYTES)
            down.append(time.perf_counter() - t0)
    finally:
        base.ggml_backend_buffer_free(buffer)
        base.ggml_free(ctx)
    seconds = max(min(up), min(down), 1e-6)
    return LINK_SAMPLE_BYTES / seconds, rtt


def _measure_compute(endpoint: str, free_bytes: int, rtt: float) -> float:
    """Bytes of Q4_0 weights device 0 of a worker reads per second in matrix-vector products
    (what decoding a token does): a chain y = W y over a zeroed matrix, timed from here.

    Nothing crosses the network but the graph and the end of the chain, so the time is the
    worker's, less one round trip. The chain is lengthened until it takes 50 ms or more."""
    _, base, rpc = _libs()
    ep = endpoint.encode()
    k = COMPUTE_MATRIX_ROWS
    matrix_bytes = k * k // 32 * 18
    if free_bytes < 4 * matrix_bytes:
        return 0.0
    backend = rpc.ggml_backend_rpc_init(ep, 0)
    if not backend:
        return 0.0
    try:
        seconds, chain = 0.0, 4
        while True:
            ctx = base.ggml_init(_InitParams(8 << 20, None, True))
            try:
                w = base.ggml_new_tensor_2d(ctx, GGML_TYPE_Q4_0, k, k)
                y = base.ggml_new_tensor_1d(ctx, GGML_TYPE_F32, k)
                for _ in range(chain):
                    y = base.ggml_mul_mat(ctx, w, y)
                graph = base.ggml_new_graph(ctx)
                base.ggml_build_forward_expand(graph, y)
                buffer = base.ggml_backend_alloc_ctx_tensors_from_buft(
                    ctx, rpc.ggml_backend_rpc_buffer_type(ep, 0))
                if not buffer:
                    return 0.0
                try:
                    base.ggml_backend_buffer_clear(buffer, 0)
                    out = ctypes.create_string_buffer(4)
                    times = []
                    for _ in range(3):  # the first warms up
                        t0 = time.perf_counter()
                        base.ggml_backend_graph_compute(backend, graph)
                        # An RPC compute has no reply; reading the result waits for its end.
                        base.ggml_backend_tensor_get(y, out, 0, 4)
                        times.append(time.perf_counter() - t0)
                    seconds = max(min(times[1:]) - rtt, 1e-6)
                finally:
                    base.ggml_backend_buffer_free(buffer)
            finally:
                base.ggml_free(ctx)
            if seconds >= 0.05 or chain >= 256:
                return chain * matrix_bytes / seconds
            chain = min(256, chain * max(2, int(0.05 / seconds) + 1))
    finally:
        base.ggml_backend_free(backend)


def probe(endpoints: tuple[str, ...]) -> Workers:
    """Each worker's devices, memory, link and compute speed, measured from this process: the
    engine's child program (engine/runner/tuner_ops.py), which exits when done and so frees the
    workers."""
    _, base, rpc = _libs()
    out = []
    for endpoint in endpoints:
        check_reachable(endpoint)
        reg = rpc.ggml_backend_rpc_add_server(endpoint.encode())
        n = base.ggml_backend_reg_dev_count(reg) if reg else 0
        if not n:
            raise WorkerError(f"RPC worker {endpoint} offers no device")
        devices = [WorkerDevice(endpoint, i, *_memory(rpc, endpoint.encode(), i))
                   for i in range(n)]
        link, rtt = _measure_link(endpoint)
        compute = _measure_compute(endpoint, devices[0].free_bytes, rtt)
        out.append(Worker(endpoint, tuple(devices), link, rtt, compute))
    return Workers(tuple(out))


# ---- the client side: loading a model with workers --------------------------------------------

def worker_devices(endpoints: list[str] | tuple[str, ...]) -> list[int]:
    """The llama.cpp devices of the workers, in the order given (each worker's devices in its
    own order): what `model_params.devices` lists before the local GPUs."""
    _, base, rpc = _libs()
    devices = []
    for endpoint in endpoints:
        check_reachable(endpoint)
        reg = rpc.ggml_backend_rpc_add_server(endpoint.encode())
        if not reg:
            raise WorkerError(f"RPC worker {endpoint} offers no device")
        devices += [base.ggml_backend_reg_dev_get(reg, i)
                    for i in range(base.ggml_backend_reg_dev_count(reg))]
    return devices


def local_gpu_devices() -> list[int]:
    """This machine's GPUs as llama.cpp lists them by default (RPC devices excluded)."""
    reg, base, _ = _libs()
    devices = []
    for i in range(reg.ggml_backend_dev_count()):
        dev = reg.ggml_backend_dev_get(i)
        if base.ggml_backend_dev_type(dev) == DEVICE_GPU and not \
                base.ggml_backend_dev_name(dev).decode().startswith("RPC"):
            devices.append(dev)
    return devices


class _Keepalive:
    def __init__(self, array):
        self.array = array


def apply_devices(model_params, endpoints: list[str] | tuple[str, ...]) -> _Keepalive | None:
    """Point `model_params.devices` at the workers' devices followed by the local GPUs (the
    order llama.cpp itself uses: remote first, so that the output layer and its logits stay on
    this machine). `tensor_split` and `n_gpu_layers` then count over this list. Keep the
    returned object alive until the model is loaded. None (no change) without endpoints."""
    if not endpoints:
        return None
    devices = worker_devices(endpoints) + local_gpu_devices()
    array = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)
    model_params.devices = ctypes.cast(array, ctypes.c_void_p)
    return _Keepalive(array)
