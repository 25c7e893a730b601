"""The admission middleware in-process: slow clients are cut off, counts stay exact, and a
request counts only once its body is complete."""

from __future__ import annotations

import asyncio

from render_server.http.admission import Admission, AdmissionMiddleware


def test_a_client_that_stops_reading_is_cut_off_and_the_stream_cancelled() -> None:
    cancelled = asyncio.Event()

    async def endless_stream(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        try:
            while True:
                await send(
                    {"type": "http.response.body", "body": b"data: x\n\n", "more_body": True}
                )
        except BaseException:
            cancelled.set()
            raise

    async def main() -> Admission:
        admission = Admission(max_pending=4, write_timeout_s=0.2)
        middleware = AdmissionMiddleware(endless_stream, admission)
        sent = 0

        async def send(message) -> None:
            nonlocal sent
            sent += 1
            if sent > 3:
                await asyncio.sleep(3600)  # the client's window is full: it never drains

        async def receive() -> dict:
            return {"type": "http.request", "body": b"{}", "more_body": False}

        scope = {"type": "http", "path": "/v1/chat/completions"}
        await asyncio.wait_for(middleware(scope, receive, send), 5)
        assert cancelled.is_set()
        return admission

    admission = asyncio.run(main())
    assert admission.slow_clients == 1
    assert admission.in_flight == 0


def test_other_paths_pass_untouched_and_uncounted() -> None:
    seen = []

    async def app(scope, receive, send) -> None:
        seen.append(scope["path"])

    async def main() -> Admission:
        admission = Admission(max_pending=0, write_timeout_s=1)
        await AdmissionMiddleware(app, admission)({"type": "http", "path": "/tokenize"}, None, None)
        return admission

    admission = asyncio.run(main())
    assert seen == ["/tokenize"]
    assert admission.rejected == 0


def test_a_request_counts_only_once_its_body_is_complete() -> None:
    pieces: asyncio.Queue[dict] = asyncio.Queue()
    seen: list[tuple[int, dict]] = []

    async def app(scope, receive, send) -> None:
        seen.append((admission.in_flight, await receive()))

    admission = Admission(max_pending=1, write_timeout_s=1)
    middleware = AdmissionMiddleware(app, admission)

    async def main() -> None:
        scope = {"type": "http", "path": "/v1/chat/completions"}
        request = asyncio.create_task(middleware(scope, pieces.get, None))
        await pieces.put({"type": "http.request", "body": b'{"a":', "more_body": True})
        await asyncio.sleep(0)
        assert admission.in_flight == 0  # half a body holds no slot
        await pieces.put({"type": "http.request", "body": b" 1}", "more_body": False})
        await asyncio.wait_for(request, 5)

    asyncio.run(main())
    # Counted while the app ran, and the app got the whole body in one message.
    assert seen == [(1, {"type": "http.request", "body": b'{"a": 1}', "more_body": False})]
    assert admission.in_flight == 0


def test_a_client_gone_before_its_body_is_complete_never_reaches_the_app() -> None:
    messages = iter([{"type": "http.request", "body": b"{", "more_body": True},
                     {"type": "http.disconnect"}])  # fmt: skip

    async def app(scope, receive, send) -> None:
        raise AssertionError("the app was called")

    async def receive() -> dict:
        return next(messages)

    admission = Admission(max_pending=1, write_timeout_s=1)
    scope = {"type": "http", "path": "/v1/completions"}
    asyncio.run(AdmissionMiddleware(app, admission)(scope, receive, None))
    assert admission.in_flight == 0
    assert admission.rejected == 0
