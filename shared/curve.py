"""CURVE key directories for untrusted networks, and the worker's ZAP allow-list.

Layout of `--zmq-curve-dir DIR` (files in zmq.auth's certificate format):

    worker side:  DIR/worker.key_secret        the worker's key pair
                  DIR/authorized/*.key         public keys of render servers allowed in
    render side:  DIR/render.key_secret        the render server's key pair
                  DIR/worker.key               the worker's public key

`python -m shared.curve DIR` writes a matching set for one worker and one render server
(copy `render.key` into the worker's `authorized/`; more render keys can be added there).
A render server whose public key is not in `authorized/` cannot talk to the worker: the
ZAP handler refuses its handshake, so not even a Hello gets through. Secret key files are
written 0600, and a secret key file other users can read is refused when it is loaded.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from shared.transport import CurveKeys

WORKER_SECRET = "worker.key_secret"
WORKER_PUBLIC = "worker.key"
RENDER_SECRET = "render.key_secret"
AUTHORIZED_DIR = "authorized"


def worker_keys(directory: Path) -> CurveKeys:
    """The worker's key pair from a curve directory."""
    return CurveKeys.from_files(directory / WORKER_SECRET)


def render_keys(directory: Path) -> CurveKeys:
    """The render server's key pair plus the worker's public key."""
    return CurveKeys.from_files(directory / RENDER_SECRET, directory / WORKER_PUBLIC)


def start_authenticator(context: zmq.Context, directory: Path) -> ThreadAuthenticator:
    """A ZAP handler on `context` that lets in only the render keys in `authorized/`."""
    authorized = directory / AUTHORIZED_DIR
    if not authorized.is_dir():
        raise FileNotFoundError(f"{authorized} is missing: put allowed render public keys there")
    authenticator = ThreadAuthenticator(context)
    authenticator.start()
    authenticator.configure_curve(domain="*", location=str(authorized))
    return authenticator


def generate(directory: Path) -> None:
    """Write a worker key pair, a render key pair (secret keys 0600), and authorize that
    render key. Existing keys of the same names are replaced."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / AUTHORIZED_DIR).mkdir(exist_ok=True)
    # pyzmq creates key files as the umask allows (0644, usually). Created in a directory
    # only we can enter (mkdtemp: 0700) and made 0600 before they are moved in, secret
    # keys are never readable by others, whatever the umask, even for a moment.
    with tempfile.TemporaryDirectory(dir=directory) as private:
        for name in ("worker", "render"):
            public, secret = zmq.auth.create_certificates(private, name)
            os.chmod(secret, 0o600)
            for path in (public, secret):
                os.replace(path, directory / os.path.basename(path))
    shutil.copy(directory / "render.key", directory / AUTHORIZED_DIR / "render.key")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m shared.curve DIR")
    generate(Path(sys.argv[1]))
    print(f"wrote worker and render keys to {sys.argv[1]}")
