"""render_server must never import torch: CPU render nodes do not have it.

A fresh interpreter installs a meta-path hook that makes any `import torch` fail loudly
(and records the attempt), builds the app with default settings, serves one real request
through uvicorn on a loopback port, and reports what it saw.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import asyncio, importlib.abc, json, socket, sys

    attempts = []

    class BlockTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                attempts.append(name)
                raise ModuleNotFoundError(f"{name} is blocked: render_server must not import torch")
            return None

    sys.meta_path.insert(0, BlockTorch())

    import httpx
    import uvicorn

    from render_server.http.app import create_app
    from render_server.settings import RenderSettings
    from tests.helpers.waiting import wait_until_async

    async def main():
        app = create_app(RenderSettings())
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve())

        def started():
            if task.done():
                task.result()  # it exited: raise what stopped it
            return server.started

        await wait_until_async(started, 120, "uvicorn to start")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            response = await client.post("/tokenize", json={"messages": [
                {"role": "user", "content": "hello"}]})
        server.should_exit = True
        await task
        return response.status_code

    status = asyncio.run(main())
    print(json.dumps({
        "status": status,
        "attempts": attempts,
        "torch_modules": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
    }))
    """
)


@pytest.mark.slow  # a fresh interpreter imports the render tier and serves a request
def test_render_server_serves_without_torch() -> None:
    # From the repository root, where the child finds `tests.helpers` as pytest does.
    result = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=180, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["status"] == 200
    assert report["torch_modules"] == []
    assert report["attempts"] == [], f"something tried to import torch: {report['attempts']}"
