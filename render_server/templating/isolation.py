"""Request-supplied chat templates render in child processes, where they can be killed.

In a thread, the deadline stops a render by raising an exception into it, and that only
fires between bytecodes. One C call a template makes with values the sandbox allows runs
for seconds holding the GIL (`x in [s] * 3000000` with long strings, joining or printing a
list of long strings), so it outlives the deadline and stalls the event loop meanwhile. A
child process has its own GIL and is killed at the deadline. The server's own template is
code the operator chose and keeps rendering in threads.

A child renders one template at a time: it reads a request (source, context and a time
limit) from stdin and writes one reply (the text, or the error) to stdout, each frame an
8-byte length and JSON. Its address space is capped, and an alarm ends it a little past the
deadline should the server be gone and unable to kill it. Run as
`python -m render_server.templating.isolation MAX_OUTPUT_CHARS MEMORY_BYTES`.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from render_server.templating.errors import (
    ChatTemplateError,
    ChatTemplateTimeout,
    ChatTemplateTooLarge,
)
from render_server.templating.sandbox import SandboxEnvironment

# A child's address space: far more than a render of the largest request needs, and a value
# built past it fails in the child (MemoryError) instead of swapping the host.
MEMORY_LIMIT_BYTES = 1 << 30
_HEADER = struct.Struct("<Q")
_ORPHAN_GRACE_S = 1.0
_ERRORS: dict[str, type[ChatTemplateError]] = {
    "ChatTemplateError": ChatTemplateError,
    "ChatTemplateTooLarge": ChatTemplateTooLarge,
}
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


class TemplateProcesses:
    """The children rendering request-supplied templates, each kept for the next render
    and killed when one passes its deadline or goes wrong in any way other than a template
    error. One idle child is kept started ahead (a start is a Python start and a jinja
    import, 0.1 s or more), so a request does not wait for one within its own deadline."""

    def __init__(self, max_output_chars: int, memory_limit_bytes: int = MEMORY_LIMIT_BYTES):
        self._args = [str(max_output_chars), str(memory_limit_bytes)]
        self._idle: list[_Child] = []
        self._lock = threading.Lock()
        self._closed = False
        self._start_spare()

    def render(self, source: str, context: dict[str, Any], deadline: float) -> str:
        """The template's text, rendered by a child; ChatTemplateTimeout at the monotonic
        `deadline`, ChatTemplateError for whatever the template did wrong."""
        child = self._take()
        self._start_spare()
        try:
            # The child stops itself a little past the deadline too, in case this process
            # is gone by then (killed) and nobody else will.
            limit_s = deadline - time.monotonic() + _ORPHAN_GRACE_S
            request = {"source": source, "context": context, "limit_s": limit_s}
            reply = child.ask(request, deadline)
        except BaseException:  # the deadline, a dead child, or the caller's interrupt
            child.kill()
            raise
        with self._lock:
            reusable = not self._closed
            if reusable:
                self._idle.append(child)
        if not reusable:
            child.kill()
        if "error" in reply:
            raise _ERRORS.get(reply["error"], ChatTemplateError)(reply["message"])
        text: str = reply["text"]
        return text

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for child in idle:
            child.kill()

    def _take(self) -> _Child:
        with self._lock:
            while self._idle:
                child = self._idle.pop()
                if child.process.poll() is None:
                    return child
                child.kill()  # died idle (the OOM killer?): reaped, pipes closed
        return _Child(self._args)

    def _start_spare(self) -> None:
        with self._lock:
            if not self._closed and not self._idle:
                self._idle.append(_Child(self._args))


class _Child:
    """One child process and its pipes."""

    def __init__(self, args: list[str]) -> None:
        # The child imports this package from where the server does, whatever its cwd.
        path = [_PACKAGE_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,  # a Ctrl-C for the server's group is the server's alone
        )

    def ask(self, request: dict[str, Any], deadline: float) -> dict[str, Any]:
        process = self.process
        assert process.stdin is not None and process.stdout is not None
        try:
            _write_frame(process.stdin, request)
        except OSError:  # BrokenPipeError: it died since it was last used
            raise self._died() from None
        header = self._read(_HEADER.size, deadline)
        reply: dict[str, Any] = json.loads(self._read(_HEADER.unpack(header)[0], deadline))
        return reply

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()

    def _read(self, size: int, deadline: float) -> bytes:
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        readable = select.poll()  # not select.select: a busy server's fds pass 1024
        readable.register(fd, select.POLLIN)
        data = bytearray()
        while len(data) < size:
            remaining_ms = (deadline - time.monotonic()) * 1000
            if remaining_ms <= 0 or not readable.poll(remaining_ms):
                raise ChatTemplateTimeout("chat template render was stopped at its deadline")
            chunk = os.read(fd, min(size - len(data), 1 << 20))
            if not chunk:
                raise self._died()
            data += chunk
        return bytes(data)

    def _died(self) -> ChatTemplateError:
        code = self.process.wait()
        return ChatTemplateError(f"chat template render process exited with code {code}")


def _write_frame(stream: IO[bytes], value: dict[str, Any]) -> None:
    # Lone surrogates are valid in JSON text from a request; surrogatepass carries them over
    # (json.loads reads bytes with it too).
    payload = json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")
    stream.write(_HEADER.pack(len(payload)) + payload)
    stream.flush()


def _read_frame(stream: IO[bytes]) -> dict[str, Any] | None:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None  # the server closed the pipe: it is gone
    value: dict[str, Any] = json.loads(stream.read(_HEADER.unpack(header)[0]))
    return value


def main() -> None:
    max_output_chars, memory_limit_bytes = map(int, sys.argv[1:3])
    resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))
    env = SandboxEnvironment(max_output_chars)
    compile_template = functools.lru_cache(maxsize=32)(
        lambda source: env.compile_template(env.parse_template(source))
    )
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but replies may reach the pipe
    while (request := _read_frame(requests)) is not None:
        # SIGALRM's default action ends the process: nothing in a render can outlive it.
        signal.setitimer(signal.ITIMER_REAL, max(request["limit_s"], 0.001))
        try:
            template = compile_template(request["source"])
            reply = {"text": env.generate_text(template, request["context"])}
        except ChatTemplateError as exc:
            reply = {"error": type(exc).__name__, "message": exc.message}
        signal.setitimer(signal.ITIMER_REAL, 0)
        _write_frame(replies, reply)


if __name__ == "__main__":
    main()
