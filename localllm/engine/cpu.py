"""This CPU and the engine built for it: which instruction sets the CPU has, which ones llama.cpp
was compiled with, and what to tell a user whose engine crashed on it.

    python -m localllm.engine.cpu --built-for     what the installed engine was compiled for

The install prints that line. A crash of the engine (SIGSEGV, SIGILL) while a model loads is
named with this CPU's features, since a kernel that is wrong on one CPU is right on most others
(ggml's AMX kernels crashed on Sapphire Rapids: patches/0001-no-amx.patch).
"""

from __future__ import annotations

import os
import re
import signal
import sys

# The instruction sets ggml picks kernels by, in the order a reader expects them.
NOTABLE = ("avx2", "fma", "f16c", "avx512f", "avx512_vbmi", "avx512_vnni", "avx512_bf16",
           "avx_vnni", "amx_tile", "amx_int8", "amx_bf16", "sve", "asimddp", "i8mm")
# The signals a broken kernel dies of: a bad access, an instruction this CPU lacks, a misaligned
# access, an integer division by zero.
CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGILL, signal.SIGBUS, signal.SIGFPE})
AMX_FLAGS = ("amx_tile", "amx_int8", "amx_bf16")
# A test hook: "CPU FLAGS|BUILT FOR" stands for this CPU's flags and the engine's build line, as
# a machine with AMX would show them (no such CPU where the tests run).
AMX_HOOK = "LOCALLLM_TEST_AMX"


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags as the kernel lists them (x86 `flags`, ARM `Features`)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def notable_features(flags: frozenset[str] | None = None) -> list[str]:
    """The flags among NOTABLE that this CPU has, e.g. ['avx2', 'avx512f', 'amx_int8']."""
    flags = cpu_flags() if flags is None else flags
    return [f for f in NOTABLE if f in flags]


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def built_for(system_info: str) -> str:
    """`AVX2 AVX512 AVX512_VNNI, no AMX` from llama.cpp's system info line (`CPU : SSE3 = 1 |
    AVX = 1 | ...`): the instruction sets it was compiled with, and whether AMX is among them."""
    on = re.findall(r"\b([A-Z0-9_]+) = 1\b", system_info)
    shown = [f for f in on if f.startswith(("AVX", "AMX", "FMA", "F16C", "SVE", "NEON",
                                             "DOTPROD", "MATMUL_INT8"))]
    amx = "with AMX" if any(f.startswith("AMX") for f in on) else "no AMX"
    if any(f.startswith(("AVX", "AMX")) for f in shown) or "x86" in system_info:
        return f"{' '.join(shown) or 'baseline x86-64'}, {amx}"
    return " ".join(shown) or "baseline"


def engine_built_for() -> str:
    """What the installed engine was compiled for (loads llama.cpp)."""
    import llama_cpp

    llama_cpp.llama_backend_init()
    return built_for(llama_cpp.llama_print_system_info().decode(errors="replace"))


def amx_hazard(flags: frozenset[str] | None = None, built: str | None = None) -> str:
    """Why llama.cpp's extra buffer types stay off on this machine ("" when they need not): an
    engine built with AMX (a plain `pip install`; scripts/install.sh builds without it) on a CPU
    that has AMX runs ggml's AMX kernels, which crashed on every answer on Sapphire Rapids
    (patches/0001-no-amx.patch). The runner asks, before its load: the engine's build is asked
    of the engine (loaded), and only on an AMX CPU."""
    if (hook := os.environ.get(AMX_HOOK)) is not None:
        hooked_flags, _, built = hook.partition("|")
        flags = frozenset(hooked_flags.split())
    flags = cpu_flags() if flags is None else flags
    if not any(f in flags for f in AMX_FLAGS):
        return ""
    if built is None:
        built = engine_built_for()
    if "with AMX" not in built:
        return ""
    return ("extra buffer types (repack, AMX) off: the engine was built with AMX and this CPU "
            "has it, where ggml's AMX kernels crash; rebuild it with scripts/install.sh (AMX "
            "off) to have them")


def is_engine_crash(exit_code: int | None) -> bool:
    """Whether a runner's exit code (negative: the signal) is a crash of the engine's code."""
    return exit_code is not None and exit_code < 0 and -exit_code in CRASH_SIGNALS


def describe_crash(exit_code: int, extra_bufts: bool) -> str:
    """What a user reads when the engine crashed on this CPU: which CPU, what it has, and what
    to do next."""
    name = signal.Signals(-exit_code).name
    features = ", ".join(notable_features()) or "no AVX2"
    advice = ("the daemon retries with llama.cpp's extra buffer types off (repack, AMX)"
              if extra_bufts else
              "rebuild the engine for this CPU (rm -rf ~/.cache/localllm/wheels, then "
              "scripts/install.sh) and report it with the runner log")
    return (f"llama.cpp crashed ({name}) on this CPU ({cpu_model()}; {features}): {advice}")


def main(argv: list[str]) -> int:
    if argv[1:] == ["--built-for"]:
        print(engine_built_for())
        return 0
    print("usage: python -m localllm.engine.cpu --built-for", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
