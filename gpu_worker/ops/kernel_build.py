"""Building duet's CPU kernel extension so that no start can wait on a build forever.

torch's JIT (`torch.utils.cpp_extension.load`) serializes the builders of one extension with
a lock file (`<build directory>/lock`) that only its holder deletes: a builder killed in the
middle (Ctrl-C on a first start that seems slow, a test's start-up deadline, the OOM killer)
leaves it, and every later load waits on it forever, silently. So a duet builder first takes
an OS lock (`flock`) on a file beside the build directory, which the kernel drops when its
holder dies however it dies. Holding it, a builder knows that no other one is inside: it
waits out the compilers a killed holder left running (their working directory is the build
directory) and removes torch's stale lock file. Waiting for a live holder has a deadline.

`python -m gpu_worker.ops.kernel_build` builds once at install (`make install`, the images),
so that a worker start only loads the module; a start that finds none still builds it.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

ENV_SWITCH = "DUET_CPU_GGUF_KERNELS"

# How long a start waits for another live process's build before it goes on without the
# kernels: a cold build takes about a minute on 2 quiet cores and 3-4 on loaded ones.
BUILD_WAIT_S = 300.0

CSRC = Path(__file__).parent / "csrc"

# Processes of a build that ninja starts in the build directory (gcc's drivers and passes).
_BUILD_TOOLS = frozenset({"ninja", "c++", "g++", "gcc", "cc", "cc1plus", "as", "ld", "collect2"})


class BuildWaitTimeout(RuntimeError):
    """Another live process held the build lock for longer than the caller would wait."""


def kernels_enabled() -> bool:
    """False when the environment turns duet's CPU kernels off."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class ExtensionSpec:
    """One extension as torch's JIT builds it: a module name unique to the machine's CPU,
    torch and the checkout, its sources and flags, and the root it is built under."""

    name: str
    sources: tuple[Path, ...]
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]
    root: Path

    @property
    def build_directory(self) -> Path:
        return self.root / self.name

    @property
    def lock_path(self) -> Path:
        # Beside the build directory, not in it: torch owns what is inside.
        return self.root / f"{self.name}.lock"

    @property
    def library(self) -> Path:
        return self.build_directory / f"{self.name}.so"

    def is_built(self) -> bool:
        """True when the module exists and is newer than every source (ninja's own test)."""
        try:
            built = self.library.stat().st_mtime
        except OSError:
            return False
        return all(source.stat().st_mtime <= built for source in self.sources)


def _build_tag(sources: tuple[Path, ...]) -> str:
    """A short hash of what the binary depends on beyond its sources: the CPU's feature
    flags (the build uses -march=native, so a cache shared between machines must not hand
    one CPU's binary to another), torch's and Python's versions (the ABI), and where the
    sources are (two checkouts on one machine must not take turns rebuilding one directory)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        flags = next((ln for ln in info.splitlines() if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    where = str(sources[0].parent.resolve())
    key = "\0".join([flags, torch.__version__, sys.version.split()[0], where])
    return hashlib.sha1(key.encode()).hexdigest()[:8]


def extensions_root() -> Path:
    """torch's root for JIT builds: `TORCH_EXTENSIONS_DIR`, else its user cache folder."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def cpu_kernels_spec() -> ExtensionSpec:
    """duet's one CPU extension: gguf_gemv.cpp defines the module and registers cpu_ops.cpp's
    functions (decode attention, KV write, RMSNorm, rotary)."""
    sources = (CSRC / "gguf_gemv.cpp", CSRC / "cpu_ops.cpp")
    return ExtensionSpec(
        name=f"duet_cpu_kernels_{_build_tag(sources)}",
        sources=sources,
        # -ffp-contract=off keeps gguf's separate multiply and add when dequantizing;
        # -fopenmp makes at::parallel_for use torch's (already loaded) OpenMP pool.
        cflags=("-O3", "-march=native", "-ffp-contract=off", "-fopenmp"),
        ldflags=("-fopenmp",),
        root=extensions_root(),
    )


def load(spec: ExtensionSpec, *, wait_s: float = BUILD_WAIT_S) -> ModuleType:
    """The built module, building it first where needed, under the build lock.

    Raises BuildWaitTimeout when another live process builds for longer than `wait_s`, and
    whatever the build raises when it fails (no compiler, a compile error)."""
    from torch.utils.cpp_extension import load as jit_load

    spec.build_directory.mkdir(parents=True, exist_ok=True)
    with build_lock(spec.lock_path, wait_s):
        clear_killed_build(spec.build_directory, wait_s)
        if not spec.is_built():
            logger.info(
                "building CPU kernels in %s (once per install or source change)",
                spec.build_directory,
            )
        _put_ninja_on_path()
        module = jit_load(
            name=spec.name,
            sources=[str(s) for s in spec.sources],
            extra_cflags=list(spec.cflags),
            extra_ldflags=list(spec.ldflags),
            build_directory=str(spec.build_directory),
            verbose=False,
        )
    assert isinstance(module, ModuleType)
    return module


@contextmanager
def build_lock(path: Path, wait_s: float) -> Iterator[None]:
    """Holds an exclusive flock on `path`, whose content names the holder's pid; polls for
    it until `wait_s` has passed, then raises BuildWaitTimeout."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        waiting = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                if time.monotonic() >= deadline:
                    raise BuildWaitTimeout(
                        f"gave up after {wait_s:.0f} s waiting for pid {holder}, which is "
                        f"building the CPU kernels (lock {path})"
                    ) from None
                if not waiting:
                    logger.info(
                        "waiting for pid %s, which is building the CPU kernels (up to %.0f s)",
                        holder,
                        wait_s,
                    )
                    waiting = True
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # drops the flock


def clear_killed_build(directory: Path, wait_s: float) -> None:
    """What a builder killed inside `directory` left behind, cleared by the lock's holder:
    its compilers (ninja does not die with its parent) are waited out, so two builds never
    write one object file, and torch's lock file is removed."""
    deadline = time.monotonic() + wait_s
    leftovers = build_processes_in(directory)
    if leftovers:
        logger.info("waiting for a killed build's compilers (pids %s) to end", leftovers)
    while leftovers:
        if time.monotonic() >= deadline:
            raise BuildWaitTimeout(
                f"a killed build's compilers (pids {leftovers}) still run in {directory}"
            )
        time.sleep(0.2)
        leftovers = build_processes_in(directory)
    stale = directory / "lock"
    if stale.exists():
        logger.info("removing the lock file a killed CPU kernel build left in %s", directory)
        stale.unlink(missing_ok=True)


def build_processes_in(directory: Path) -> list[int]:
    """Pids of compilers and ninja working in `directory` (Linux's /proc; none elsewhere)."""
    found = []
    target = str(directory.resolve())
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if os.readlink(entry / "cwd") != target:
                continue
            command = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if command in _BUILD_TOOLS:
            found.append(int(entry.name))
    return found


def _put_ninja_on_path() -> None:
    """torch's JIT build runs `ninja` from PATH; the pip package (the `worker` extra)
    installs it into the venv's bin, which is not on PATH when the venv is not activated."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    bin_dir = getattr(ninja, "BIN_DIR", None)
    if bin_dir:
        os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])


def main() -> int:
    """Builds the CPU kernels once for this install; a failure is a warning, not an error,
    since the worker then serves on dense weights and torch ops."""
    if not kernels_enabled():
        print(f"duet CPU kernels turned off ({ENV_SWITCH}); nothing to build")
        return 0
    spec = cpu_kernels_spec()
    if spec.is_built():
        print(f"duet CPU kernels already built: {spec.library}")
        return 0
    print("building duet's CPU kernels for this machine (once per install, about a minute)")
    started = time.monotonic()
    try:
        load(spec)
    except Exception as exc:  # noqa: BLE001 - the worker falls back; say why and go on
        print(f"warning: duet CPU kernels not built, the worker will use dense ops: {exc}")
        return 0
    print(f"built in {time.monotonic() - started:.0f} s: {spec.library}")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(main())
