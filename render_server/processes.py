"""`render-serve --processes N`: N render processes serving one port.

The parent binds the listening socket once and starts N children (`python -m
render_server.processes`). Each child is a whole render server (tokenizer, chat template,
its own WorkerPool connected to every worker) accepting on the inherited socket; the
kernel hands each new connection to whichever child accepts it first. The parent holds no
app: it forwards SIGTERM and SIGINT to the children (each drains exactly like a single
render-serve), starts a new child when one dies, and exits 0 once every child exited 0.

Metrics use prometheus_client's multiprocess mode. The parent makes a private directory
and names it both in the children's PROMETHEUS_MULTIPROC_DIR (prometheus_client reads it
once, at import, so it must be in their environment from the start) and in their
settings. Every child keeps its counters and histograms in files there, and /metrics in
any child sums the files of all, including those of children that died since.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from render_server.serve import announce, build_app, configure_logging, serve_app
from render_server.settings import RenderSettings

logger = logging.getLogger(__name__)

_SETTINGS_ENV = "_DUET_RENDER_SETTINGS"
"""The children's RenderSettings as JSON; in the environment, not argv, as it may hold
API keys."""
_LISTEN_FD_ENV = "_DUET_LISTEN_FD"
_PARENT_ENV = "_DUET_PARENT_PID"
_CANNOT_START = (2, 3)
"""Child exit codes for a bad configuration (2, as render-serve) or a failed startup (3):
a new child would fail alike, so the whole server stops."""
_POLL_S = 0.2
_MIN_RESPAWN_INTERVAL_S = 5.0
"""A slot whose child keeps crashing is restarted at most this often."""
_BACKLOG = 2048  # uvicorn's default


def serve_processes(settings: RenderSettings) -> int:
    """Serve with `settings.processes` render processes until a signal stops them all.
    Returns the exit code: 0 when every child drained and exited cleanly."""
    if settings.response_store == "memory://":
        # A warning rather than a refusal: most clients never store a response, and
        # those that do learn why a follow-up got 404 from this line.
        logger.warning(
            "stored responses are per process: each of the %d render processes keeps its "
            "own, so a retrieve or previous_response_id that reaches another process gets "
            "404; share them with --response-store redis://HOST:PORT/DB",
            settings.processes,
        )
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    try:
        listener = socket.create_server(
            (settings.host, settings.port), family=family, backlog=_BACKLOG
        )
    except OSError as exc:
        logger.error("cannot listen on %s:%d: %s", settings.host, settings.port, exc)
        return 1
    metrics_dir = Path(tempfile.mkdtemp(prefix="duet-metrics-"))  # mode 0700
    try:
        child_settings = settings.model_copy(update={"metrics_multiprocess_dir": metrics_dir})
        supervisor = _Supervisor(child_settings, listener)
        return supervisor.run(
            on_started=lambda: announce(settings, listener.getsockname()[1], settings.processes)
        )
    finally:
        listener.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)


@dataclass
class _Child:
    process: subprocess.Popen[bytes]
    started_at: float = field(default_factory=time.monotonic)


class _Supervisor:
    """Starts the children, keeps their number, forwards stop signals, reaps them."""

    def __init__(self, settings: RenderSettings, listener: socket.socket) -> None:
        self._count = settings.processes
        self._listener = listener
        self._env = {
            **os.environ,
            "PROMETHEUS_MULTIPROC_DIR": str(settings.metrics_multiprocess_dir),
            _SETTINGS_ENV: settings.model_dump_json(),
            _LISTEN_FD_ENV: str(listener.fileno()),
            _PARENT_ENV: str(os.getpid()),
        }
        self._children: list[_Child] = []
        # Filled by the signal handler, drained by the loop: forwarding from the loop
        # rather than the handler means a child started meanwhile is never missed.
        self._signals: collections.deque[int] = collections.deque()

    def run(self, on_started: Callable[[], None]) -> int:
        """Serve until stopped; `on_started` runs once the children are started and a stop
        signal would reach them (announcing earlier left a window where SIGTERM killed the
        supervisor outright)."""
        handled = (signal.SIGTERM, signal.SIGINT)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in handled}
        try:
            self._children = [self._spawn() for _ in range(self._count)]
            on_started()
            return self._watch()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        self._signals.append(sig)

    def _spawn(self) -> _Child:
        process = subprocess.Popen(
            [sys.executable, "-m", "render_server.processes"],
            env=self._env,
            pass_fds=(self._listener.fileno(),),
            # Its own process group: a terminal's Ctrl-C reaches the parent only, which
            # forwards it once (a second SIGINT would make them drop their requests).
            process_group=0,
        )
        logger.info("started render process %d", process.pid)
        return _Child(process)

    def _watch(self) -> int:
        stopping = False
        while True:
            while self._signals:
                sig = self._signals.popleft()
                if not stopping:
                    stopping = True
                    logger.info(
                        "%s: stopping %d render processes", signal.Signals(sig).name, self._count
                    )
                    # No child is started from here on. Held open here, the socket would
                    # go on queueing connections after the last child stops accepting,
                    # each reset when this process exits; closed, they are refused.
                    self._listener.close()
                for child in self._children:
                    if child.process.poll() is None:
                        child.process.send_signal(sig)
            if stopping:
                if all(child.process.poll() is not None for child in self._children):
                    codes = [child.process.returncode for child in self._children]
                    return 0 if all(map(_stopped_cleanly, codes)) else 1
            elif (failed := self._replace_dead()) is not None:
                return failed
            time.sleep(_POLL_S)

    def _replace_dead(self) -> int | None:
        """Start a new child in place of each dead one. Returns an exit code when a child
        could not start at all (the others are stopped then)."""
        for index, child in enumerate(self._children):
            code = child.process.poll()
            if code is None:
                continue
            if code in _CANNOT_START:
                logger.error("render process %d could not start: stopping", child.process.pid)
                self._terminate_all()
                return 2
            if time.monotonic() - child.started_at < _MIN_RESPAWN_INTERVAL_S:
                continue  # crashing early: give it a moment before the next try
            logger.warning(
                "render process %d exited with %d: starting another", child.process.pid, code
            )
            self._children[index] = self._spawn()
        return None

    def _terminate_all(self, timeout_s: float = 30.0) -> None:
        for child in self._children:
            if child.process.poll() is None:
                child.process.terminate()
        for child in self._children:
            try:
                child.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()


def _stopped_cleanly(returncode: int) -> bool:
    """A child that drained and exited 0, or one the forwarded stop signal ended while it
    was still starting (before it had handlers, or anything to drain)."""
    return returncode in (0, -signal.SIGTERM, -signal.SIGINT)


# ---- in a child ------------------------------------------------------------------------


def _exit_with_parent(parent_pid: int) -> None:
    """Get SIGTERM (and so drain) when the parent dies, even by SIGKILL (Linux only)."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError):  # no libc: the parent's own stop still works
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # it died before the line above took effect
        sys.exit(0)


def child_main() -> None:
    """Entry point of one render process; started by `serve_processes`, never by hand."""

    _exit_with_parent(int(os.environ.pop(_PARENT_ENV)))
    settings = RenderSettings.model_validate_json(os.environ.pop(_SETTINGS_ENV))
    listener = socket.socket(fileno=int(os.environ.pop(_LISTEN_FD_ENV)))
    configure_logging(settings)
    try:
        app = build_app(settings)  # exits 2 on a bad model, tokenizer or template
        started = serve_app(settings, app, sockets=[listener])
    except KeyboardInterrupt:  # the parent forwarded a SIGINT (maybe mid-startup): a stop
        return
    if not started:
        sys.exit(3)


if __name__ == "__main__":
    child_main()
