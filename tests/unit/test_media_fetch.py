"""fetch_image_bytes against a real HTTP(S) server on loopback: SSRF checks on every hop,
address pinning, byte and time bounds, and data: and file:// URLs. No internet is used:
names other than IP literals go through a fake resolver."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import ipaddress
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from render_server.multimodal.media_error import MediaError
from render_server.multimodal.media_fetch import (
    MediaPolicy,
    fetch_image_bytes,
    make_media_client,
)

pytestmark = pytest.mark.timeout(30)

IMAGE = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
# Loopback is where the test server lives; policies open exactly 127.0.0.1 so that every
# other internal address stays refused.
SERVER_ONLY = MediaPolicy(allowed_private_networks=("127.0.0.1/32",), fetch_timeout_s=5.0)


class Handler(BaseHTTPRequestHandler):
    """The test server's routes: an image, redirects, slow, big and echoing bodies."""

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        parts = urlsplit(self.path)
        query = parse_qs(parts.query)
        route = {
            "/image.png": self.image,
            "/redirect": lambda: self.redirect(query["to"][0]),
            "/loop": lambda: self.redirect("/loop"),
            "/slow": self.slow,
            "/big": self.big,
            "/big-declared": self.big_declared,
            "/host": self.host,
        }.get(parts.path)
        if route is None:
            self.send_error(404)
            return
        # The client gives up on the slow and big bodies, as those tests mean it to.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, ssl.SSLError):
            route()

    def body(self, data: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def image(self) -> None:
        self.body(IMAGE)

    def host(self) -> None:
        self.body(self.headers["Host"].encode())

    def redirect(self, to: str) -> None:
        self.send_response(302)
        self.send_header("Location", to)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def slow(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "1000")
        self.end_headers()
        for _ in range(20):
            self.wfile.write(b"x")
            self.wfile.flush()
            time.sleep(0.1)

    def big(self) -> None:
        # No Content-Length: only counting the streamed bytes can stop it.
        self.send_response(200)
        self.send_header("Connection", "close")
        self.end_headers()
        for _ in range(64):
            self.wfile.write(b"\0" * 65536)

    def big_declared(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(10**12))
        self.end_headers()
        self.wfile.write(b"\0" * 1024)


def serve(context: ssl.SSLContext | None = None) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    if context is not None:
        server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """host:port of a plain HTTP server on loopback."""
    yield from serve()


class FakeResolver:
    """Names to addresses without DNS; records each lookup, and can answer differently on
    the second lookup of a name (a rebinding DNS server)."""

    def __init__(self, answers: dict[str, list[list[str]]]) -> None:
        self.answers = answers
        self.calls: list[str] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls.append(host)
        seen = self.calls.count(host) - 1
        options = self.answers.get(host, [[]])
        return options[min(seen, len(options) - 1)]


def fetch(url: str, policy: MediaPolicy, **kwargs: object) -> bytes:
    return asyncio.run(fetch_image_bytes(url, policy, **kwargs))  # type: ignore[arg-type]


def test_loopback_is_refused_by_default_and_allowed_when_the_operator_allows_it(
    server: str,
) -> None:
    with pytest.raises(MediaError, match="non-public address 127.0.0.1"):
        fetch(f"http://{server}/image.png", MediaPolicy())
    assert fetch(f"http://{server}/image.png", MediaPolicy(allow_private_addresses=True)) == IMAGE
    assert fetch(f"http://{server}/image.png", SERVER_ONLY) == IMAGE


@pytest.mark.parametrize(
    "target",
    [
        "http://169.254.169.254/latest/meta-data/",
        "http://10.0.0.1/",
        "http://172.16.0.1/",
        "http://192.168.1.1/",
        "http://100.64.0.1/",
        "http://127.0.0.2/",
        "http://0.0.0.0/",
        "http://224.0.0.1/",
        "http://[::1]/",
        "http://[::]/",
        "http://[fe80::1]/",
        "http://[fc00::1]/",
        "http://[fd00:ec2::254]/",
        "http://[::ffff:127.0.0.2]/",
        "http://[::ffff:169.254.169.254]/",
        "http://[ff02::1]/",
        "http://[2002:a00:1::]/",  # 6to4 wrapping 10.0.0.1
    ],
)
def test_a_redirect_to_an_internal_address_is_refused(server: str, target: str) -> None:
    with pytest.raises(MediaError, match="non-public address"):
        fetch(f"http://{server}/redirect?to={target}", SERVER_ONLY)


def test_a_redirect_to_an_allowed_place_is_followed(server: str) -> None:
    assert fetch(f"http://{server}/redirect?to=/image.png", SERVER_ONLY) == IMAGE


def test_a_redirect_to_another_scheme_or_in_a_loop_is_refused(server: str) -> None:
    with pytest.raises(MediaError, match="unsupported scheme 'file'"):
        fetch(f"http://{server}/redirect?to=file:///etc/passwd", SERVER_ONLY)
    with pytest.raises(MediaError, match="redirected more than 3 times"):
        fetch(f"http://{server}/loop", replace(SERVER_ONLY, max_redirects=3))


def test_the_checked_address_is_the_one_connected_to_and_the_name_is_the_host_header(
    server: str,
) -> None:
    # The second answer would rebind the name to the metadata endpoint; it is never asked.
    port = server.split(":")[1]
    resolver = FakeResolver({"images.example": [["127.0.0.1"], ["169.254.169.254"]]})
    url = f"http://images.example:{port}/host"
    assert fetch(url, SERVER_ONLY, resolver=resolver) == f"images.example:{port}".encode()
    assert resolver.calls == ["images.example"]


def test_a_name_with_any_internal_address_is_refused(server: str) -> None:
    port = server.split(":")[1]
    resolver = FakeResolver({"mixed.example": [["127.0.0.1", "10.0.0.1"]]})
    with pytest.raises(MediaError, match="non-public address 10.0.0.1"):
        fetch(f"http://mixed.example:{port}/image.png", SERVER_ONLY, resolver=resolver)
    with pytest.raises(MediaError, match="does not resolve"):
        fetch(f"http://nowhere.example:{port}/", SERVER_ONLY, resolver=FakeResolver({}))


def test_the_domain_allow_list_holds_on_every_hop(server: str) -> None:
    port = server.split(":")[1]
    resolver = FakeResolver({n: [["127.0.0.1"]] for n in ("images.example", "other.example")})
    policy = replace(SERVER_ONLY, allowed_media_domains=frozenset({"Images.Example"}))
    assert fetch(f"http://IMAGES.example:{port}/image.png", policy, resolver=resolver) == IMAGE
    with pytest.raises(MediaError, match="'other.example' is not in the allowed media domains"):
        fetch(f"http://other.example:{port}/image.png", policy, resolver=resolver)
    hop = f"http://other.example:{port}/image.png"
    with pytest.raises(MediaError, match="'other.example' is not in the allowed"):
        fetch(f"http://images.example:{port}/redirect?to={hop}", policy, resolver=resolver)
    with pytest.raises(MediaError, match="'127.0.0.1' is not in the allowed"):
        fetch(f"http://{server}/image.png", policy)


def test_a_slow_body_is_cut_at_the_fetch_timeout(server: str) -> None:
    start = time.monotonic()
    with pytest.raises(MediaError, match="timed out after 0.3 s"):
        fetch(f"http://{server}/slow", replace(SERVER_ONLY, fetch_timeout_s=0.3))
    assert time.monotonic() - start < 1.5


def test_a_body_over_the_byte_limit_is_refused_declared_or_streamed(server: str) -> None:
    policy = replace(SERVER_ONLY, max_media_bytes=100_000)
    with pytest.raises(MediaError, match="larger than the limit of 100000 bytes"):
        fetch(f"http://{server}/big", policy)
    with pytest.raises(MediaError, match="larger than the limit of 100000 bytes"):
        fetch(f"http://{server}/big-declared", policy)
    assert fetch(f"http://{server}/image.png", replace(policy, max_media_bytes=len(IMAGE)))


def test_an_error_status_and_an_unknown_scheme_are_named(server: str) -> None:
    with pytest.raises(MediaError, match="HTTP 404"):
        fetch(f"http://{server}/missing", SERVER_ONLY)
    with pytest.raises(MediaError, match="scheme 'ftp' is not supported"):
        fetch("ftp://example.com/a.png", SERVER_ONLY)
    with pytest.raises(MediaError, match="scheme '\\(none\\)'"):
        fetch("just-a-name.png", SERVER_ONLY)
    with pytest.raises(MediaError, match="failed: ConnectError"):
        fetch("http://127.0.0.1:1/image.png", SERVER_ONLY)
    with pytest.raises(MediaError, match="has no host"):
        fetch("http://:80/image.png", SERVER_ONLY)
    with pytest.raises(MediaError, match="malformed"):
        fetch("http://127.0.0.1:abc/image.png", SERVER_ONLY)


def certificate(tmp: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for `name` and its key, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / f"{name}.crt", tmp / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """host:port of an HTTPS server on loopback whose certificate names images.example,
    and that certificate (for the client to trust)."""
    cert, key = certificate(tmp_path_factory.mktemp("tls"), "images.example")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    for address in serve(context):
        yield address, cert


async def fetch_tls(url: str, cert: Path) -> bytes:
    resolver = FakeResolver({n: [["127.0.0.1"]] for n in ("images.example", "evil.example")})
    trusted = ssl.create_default_context(cafile=str(cert))
    async with make_media_client(5.0, verify=trusted) as client:
        return await fetch_image_bytes(url, SERVER_ONLY, client=client, resolver=resolver)


def test_https_to_a_pinned_address_verifies_the_certificate_against_the_name(
    tls_server: tuple[str, Path],
) -> None:
    address, cert = tls_server
    port = address.split(":")[1]
    body = asyncio.run(fetch_tls(f"https://images.example:{port}/host", cert))
    assert body == f"images.example:{port}".encode()
    # The same server under a name its certificate does not carry: verification fails.
    with pytest.raises(MediaError, match="failed: ConnectError"):
        asyncio.run(fetch_tls(f"https://evil.example:{port}/host", cert))


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def test_data_urls_decode_within_bounds() -> None:
    assert fetch(data_url(IMAGE), MediaPolicy()) == IMAGE
    wrapped = data_url(IMAGE)[:40] + "\n " + data_url(IMAGE)[40:]
    assert fetch(wrapped, MediaPolicy()) == IMAGE
    with pytest.raises(MediaError, match="larger than the limit of 100 bytes"):
        fetch(data_url(IMAGE), MediaPolicy(max_media_bytes=100))


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("data:image/png;base64,iVBORw0KGgo@@@", "malformed"),
        ("data:image/png;base64,abc", "malformed"),
        ("data:text/plain;base64,aGVsbG8=", "'text/plain' is not an image type"),
        ("data:image/png,rawbytes", "not base64-encoded"),
        ("data:image/png;base64", "no ','"),
    ],
)
def test_bad_data_urls_say_what_is_wrong(url: str, message: str) -> None:
    with pytest.raises(MediaError, match=message):
        fetch(url, MediaPolicy())


def test_file_urls_read_only_under_the_allowed_path(tmp_path: Path) -> None:
    allowed, outside = tmp_path / "media", tmp_path / "secret"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "cat.png").write_bytes(IMAGE)
    (outside / "key.png").write_bytes(b"secret")
    (allowed / "escape.png").symlink_to(outside / "key.png")
    (allowed / "inner.png").symlink_to(allowed / "cat.png")
    policy = MediaPolicy(allowed_local_media_path=allowed)

    assert fetch((allowed / "cat.png").as_uri(), policy) == IMAGE
    assert fetch((allowed / "inner.png").as_uri(), policy) == IMAGE
    assert fetch(f"file://localhost{allowed}/cat.png", policy) == IMAGE
    with pytest.raises(MediaError, match="not allowed"):
        fetch((allowed / "cat.png").as_uri(), MediaPolicy())
    for escape in [
        (outside / "key.png").as_uri(),
        (allowed / "escape.png").as_uri(),
        f"file://{allowed}/../secret/key.png",
    ]:
        with pytest.raises(MediaError, match="outside the allowed local media path"):
            fetch(escape, policy)
    with pytest.raises(MediaError, match="no readable file"):
        fetch((allowed / "missing.png").as_uri(), policy)
    with pytest.raises(MediaError, match="not name a regular file"):
        fetch(allowed.as_uri(), policy)
    with pytest.raises(MediaError, match="names a host"):
        fetch(f"file://fileserver{allowed}/cat.png", policy)
    with pytest.raises(MediaError, match="larger than the limit"):
        fetch((allowed / "cat.png").as_uri(), replace(policy, max_media_bytes=10))


def test_every_non_public_network_is_refused_by_the_address_check() -> None:
    from render_server.multimodal.media_fetch import is_address_allowed

    policy = MediaPolicy()
    assert is_address_allowed(ipaddress.ip_address("93.184.216.34"), policy)
    assert is_address_allowed(ipaddress.ip_address("2606:4700::1111"), policy)
    for internal in ["::ffff:10.1.2.3", "2001:0:4136:e378:8000:63bf:f5ff:fffe", "fe80::1"]:
        assert not is_address_allowed(ipaddress.ip_address(internal), policy)
