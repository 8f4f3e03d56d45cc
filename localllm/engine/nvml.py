"""NVIDIA's management library (pynvml): the cards this machine has, and the GPU memory each
process uses. Every call copes with no library, no driver and no GPU."""

from __future__ import annotations

import warnings


def devices() -> list[dict]:
    """Name, memory, PCIe and clocks of every NVIDIA GPU, or [] where there is none."""
    try:
        with warnings.catch_warnings():  # pynvml warns that it is deprecated, on every import
            warnings.simplefilter("ignore")
            import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:
        return []
    devices = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            info = {"name": name.decode() if isinstance(name, bytes) else str(name),
                    "total": int(mem.total), "free": int(mem.free), "index": i}
            facts = {
                "cc": lambda h: ".".join(map(str, pynvml.nvmlDeviceGetCudaComputeCapability(h))),
                "pcie_gen": pynvml.nvmlDeviceGetMaxPcieLinkGeneration,
                "pcie_width": pynvml.nvmlDeviceGetMaxPcieLinkWidth,
                "mem_clock_mhz":
                    lambda h: pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM),
                "bus_width": pynvml.nvmlDeviceGetMemoryBusWidth,
                "uuid": lambda h: _text(pynvml.nvmlDeviceGetUUID(h)),
            }
            for key, call in facts.items():
                try:
                    info[key] = call(h)
                except Exception:  # optional facts; older drivers lack some
                    pass
            devices.append(info)
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return devices


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class GpuMemory:
    """GPU memory used per process, summed over the NVIDIA GPUs; None where there are none.

    NVML is initialised once and kept: a stats poll several times a second should not pay
    nvmlInit each time.
    """

    def __init__(self) -> None:
        self._nvml = None
        self._tried = False

    def _init(self):
        if not self._tried:
            self._tried = True
            try:
                with warnings.catch_warnings():  # pynvml warns that it is deprecated
                    warnings.simplefilter("ignore")
                    import pynvml
                pynvml.nvmlInit()
                self._nvml = pynvml
            except Exception:  # no library, no driver, no GPU: all mean "no GPU memory"
                self._nvml = None
        return self._nvml

    def by_pid(self) -> dict[int, int] | None:
        nvml = self._init()
        if nvml is None:
            return None
        used: dict[int, int] = {}
        try:
            for i in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    if p.usedGpuMemory is not None:  # None: the driver does not say
                        used[p.pid] = used.get(p.pid, 0) + int(p.usedGpuMemory)
        except Exception:
            return None
        return used


def process_vram_bytes() -> int:
    """GPU memory this process holds, summed over GPUs (NVML), 0 without NVML or a GPU."""
    import os

    try:
        with warnings.catch_warnings():  # pynvml warns that it is deprecated, on every import
            warnings.simplefilter("ignore")
            import pynvml
        pynvml.nvmlInit()
    except Exception:  # no driver, no GPU
        return 0
    try:
        total = 0
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == os.getpid() and proc.usedGpuMemory:
                    total += int(proc.usedGpuMemory)
        return total
    except Exception:
        return 0
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
