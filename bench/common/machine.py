"""The machine a benchmark ran on, as its RESULTS.md section describes it."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_name() -> str:
    """The processor's name where the platform gives one, else the architecture."""
    return platform.processor() or platform.machine()


def load_average(separator: str = " / ") -> str:
    """The 1, 5 and 15 minute load averages (the machine may be shared)."""
    try:
        loads = os.getloadavg()
    except OSError:  # not every platform keeps one
        return "unknown"
    return separator.join(f"{x:.1f}" for x in loads)


def cpu_model() -> str:
    """The CPU's name and the vector extensions that decide fp32/bf16 matmul speed."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return cpu_name()
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if "model name" in ln), "")
    flags = next(
        (ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), []
    )
    wanted = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name or platform.machine()} ({', '.join(wanted) or 'no AVX2'})"


def machine() -> str:
    """CPUs, torch and its thread count, Python."""
    import torch  # here: the serving benchmarks describe their machine without it

    return (
        f"{cpu_name()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, {torch.get_num_threads()} torch thread(s), "
        f"Python {platform.python_version()}"
    )


def machine_line() -> str:
    """Python, architecture and cores: the machine of a benchmark that runs no torch itself."""
    return f"Python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} cores"
