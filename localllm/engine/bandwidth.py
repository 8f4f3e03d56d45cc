"""The card's real memory and host-to-device bandwidth, timed with torch (the optional extra) for
`localllm tune --calibrate` (profiles/calibrate.py stores them). Runs in the engine's
child program (the runner, engine/runner/tuner_ops.py), never in a process that loaded llama.cpp."""

from __future__ import annotations

from localllm.engine.probes import Bandwidth

from localllm.errors import UserError

GB = 1e9


def measure_bandwidth(device: int = 0, size_bytes: int = 1 << 30, repeats: int = 10) -> Bandwidth:
    """Best of `repeats` timed copies (CUDA events), after a warm-up."""
    try:
        import torch
    except ImportError:
        raise UserError("--calibrate needs torch: pip install 'localllm[torch]' (without it the "
                        "tuner uses NVML's theoretical bandwidth)") from None
    if not torch.cuda.is_available():
        raise UserError("--calibrate needs a CUDA GPU that torch can use; none was found")
    dev = torch.device("cuda", device)
    src = torch.empty(size_bytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    host = torch.empty(size_bytes // 4, dtype=torch.uint8, pin_memory=True)
    host_dst = torch.empty(size_bytes // 4, dtype=torch.uint8, device=dev)

    def best_seconds(copy) -> float:
        copy()
        torch.cuda.synchronize(dev)
        best = float("inf")
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            copy()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1000)
        return best

    d2d = best_seconds(lambda: dst.copy_(src))
    h2d = best_seconds(lambda: host_dst.copy_(host, non_blocking=True))
    return Bandwidth(memory_gbs=2 * size_bytes / d2d / GB,
                     host_to_device_gbs=(size_bytes // 4) / h2d / GB)
