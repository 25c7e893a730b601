"""A new user's first contact, timed: a fresh clone, `make install`, then `make serve` until
/ready answers and the first chat answer arrives, and a second `make serve` on the same
install (a restart).

`make serve` runs `make install` first and then starts render-serve, whose embedded
gpu-worker loads the model; the worker's part is the time from `make serve` on an installed
tree to /ready. The clone builds its own CPU kernels (their build tag includes the source
path) into a scratch TORCH_EXTENSIONS_DIR, and pip's cache is off by default, so the install
starts from nothing but the torch wheel this machine keeps on disk.

    python -m bench.first_start [--keep-pip-cache]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from bench.common.results_md import BENCH_DIR, RESULTS_DIR
from bench.common.subprocesses import free_port, wait_http_ok

ROOT = BENCH_DIR.parent
READY_TIMEOUT_S = 900.0


def timed(command: list[str], cwd: Path, env: dict[str, str]) -> float:
    started = time.monotonic()
    subprocess.run(command, cwd=cwd, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.monotonic() - started


def serve_until_answer(clone: Path, env: dict[str, str]) -> tuple[float, float]:
    """`make serve` from launch to /ready, and to the first chat answer (seconds)."""
    port = free_port()
    started = time.monotonic()
    process = subprocess.Popen(
        ["make", "serve", f"PORT={port}"],
        cwd=clone,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # make, render-serve and its worker stop as one group
    )
    try:
        base = f"http://127.0.0.1:{port}"
        if not wait_http_ok(f"{base}/ready", process, READY_TIMEOUT_S, poll_s=0.2):
            raise SystemExit(f"make serve was not ready in {READY_TIMEOUT_S:.0f} s")
        ready_s = time.monotonic() - started
        body = {
            "model": "SmolLM2-135M-Instruct",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16,
        }
        httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).raise_for_status()
        return ready_s, time.monotonic() - started
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep-pip-cache", action="store_true", help="let pip use its cache")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "first_start.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="duet-first-start-") as scratch:
        clone = Path(scratch) / "duet"
        subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
        env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(Path(scratch) / "extensions")}
        if not args.keep_pip_cache:
            env["PIP_NO_CACHE_DIR"] = "1"
        install_s = timed(["make", "install"], clone, env)
        first_ready_s, first_answer_s = serve_until_answer(clone, env)
        again_ready_s, again_answer_s = serve_until_answer(clone, env)
    result = {
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        "pip_cache": args.keep_pip_cache,
        "load_average_at_end": os.getloadavg()[0],
        "install_s": round(install_s, 1),
        "first_serve_ready_s": round(first_ready_s, 1),
        "first_serve_answer_s": round(first_answer_s, 1),
        "nothing_to_ready_s": round(install_s + first_ready_s, 1),
        "restart_ready_s": round(again_ready_s, 1),
        "restart_answer_s": round(again_answer_s, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
