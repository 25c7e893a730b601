"""The admission middleware in-process: slow clients are cut off, counts stay exact."""

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

        scope = {"type": "http", "path": "/v1/chat/completions"}
        await asyncio.wait_for(middleware(scope, None, send), 5)
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
