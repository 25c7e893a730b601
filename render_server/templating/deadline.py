"""Deadlines for chat template renders, which run code we did not write.

A render past its deadline gets an exception raised into its thread (CPython's
PyThreadState_SetAsyncExc), so the request fails alone and the thread lives on. Renders on
the pool are stopped by `RenderJob.abort`; renders inline in the caller's thread by one
`Watchdog` thread.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

from render_server.templating.errors import ChatTemplateTimeout

T = TypeVar("T")


class RenderInterrupted(BaseException):
    """Raised into a render thread past its deadline. A BaseException, so that no
    `except Exception` on the way (jinja's or ours) can swallow it."""


def async_raise(thread_id: int, exc_type: type[BaseException] | None) -> None:
    # None (NULL) clears an exception still pending for that thread.
    exc = ctypes.py_object(exc_type) if exc_type is not None else None
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), exc)


class RenderJob(Generic[T]):
    """One render on the pool; `abort` stops it from another thread once its deadline passed."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self._fn = fn
        self._lock = threading.Lock()
        self._thread_id: int | None = None
        self._finished = False
        self._aborted = False
        self.future: Future[T] | None = None

    def run(self) -> T:
        with self._lock:
            if self._aborted:
                raise ChatTemplateTimeout("chat template render was aborted before it started")
            self._thread_id = threading.get_ident()
        try:
            return self._fn()
        except RenderInterrupted:
            raise ChatTemplateTimeout("chat template render was stopped at its deadline") from None
        finally:
            with self._lock:
                self._finished = True
                if self._aborted:
                    # The injected exception may not have fired yet; it must not fire later in
                    # the pool's own code, which would kill the worker thread.
                    async_raise(threading.get_ident(), None)

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            if self.future is not None:
                self.future.cancel()  # still queued: it never runs
            if self._thread_id is not None and not self._finished:
                async_raise(self._thread_id, RenderInterrupted)


class InlineRender:
    """One render running in its caller's thread, as the watchdog sees it."""

    __slots__ = ("thread_id", "deadline", "finished", "interrupted")

    def __init__(self, thread_id: int, deadline: float) -> None:
        self.thread_id = thread_id
        self.deadline = deadline
        self.finished = False
        self.interrupted = False


class Watchdog:
    """One thread that stops inline renders past their deadline, by raising
    RenderInterrupted into the rendering thread (the event loop's, over HTTP).

    Every render of one renderer has the same budget, so renders are armed in deadline
    order and a deque is the whole schedule. Arming costs one lock round trip and wakes
    nobody: the thread sleeps until the oldest render falls due (dropping the finished
    ones then), and with nothing armed it still waits one budget before sleeping for good,
    since whatever is armed meanwhile falls due after that. Only arming into that last,
    untimed sleep wakes it. The lock makes "interrupt" and "finish" exclusive: an interrupt
    is only raised into a render that has not finished, and `finish` clears one still
    pending, so it can never fire in the caller's code after the render returned."""

    def __init__(self, budget_s: float) -> None:
        self._budget_s = budget_s
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._queue: deque[InlineRender] = deque()
        self._thread: threading.Thread | None = None
        self._asleep = False
        self._closed = False

    def arm(self) -> InlineRender:
        with self._lock:
            render = InlineRender(threading.get_ident(), time.monotonic() + self._budget_s)
            self._queue.append(render)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="chat-render-watchdog", daemon=True
                )
                self._thread.start()
            elif self._asleep:
                self._wakeup.notify()
            return render

    def finish(self, render: InlineRender) -> None:
        with self._lock:
            render.finished = True
            if render.interrupted:
                async_raise(render.thread_id, None)  # not fired yet: it must not fire later

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wakeup.notify()

    def _run(self) -> None:
        queue = self._queue
        idle = False
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                while queue and (queue[0].finished or queue[0].deadline <= now):
                    render = queue.popleft()
                    if not render.finished:
                        render.interrupted = True
                        async_raise(render.thread_id, RenderInterrupted)
                if queue:
                    idle = False
                    self._wakeup.wait(queue[0].deadline - now)
                elif not idle:
                    idle = True
                    self._wakeup.wait(self._budget_s)
                else:
                    self._asleep = True
                    self._wakeup.wait()
                    self._asleep = False
