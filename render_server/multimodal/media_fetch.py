"""Fetching a media URL's bytes safely: `data:`, `file://` and `http(s)://` (vLLM's knobs).

A request's image URL is attacker-chosen, and the render tier sits inside the operator's
network, so an HTTP fetch is a server-side request forgery waiting to happen. Every hop of
a redirect chain is checked (scheme, domain allow-list, resolved address), the host is
resolved once and the connection goes to the very address that was checked (no DNS
rebinding between check and connect), and the body is bounded in bytes and in time.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import os
import socket
import ssl
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx

from render_server.multimodal.media_error import MediaError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# host, port -> the addresses it resolves to, as strings (loop.getaddrinfo by default).
Resolver = Callable[[str, int], Awaitable[list[str]]]

REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})


@dataclass(frozen=True)
class MediaPolicy:
    """What a media URL may point at, and how much of it is read."""

    allowed_media_domains: frozenset[str] | None = None
    """Hosts an http(s) URL (and each redirect hop) may name, matched exactly and without
    case; None allows any host whose address is public."""
    allowed_local_media_path: Path | None = None
    """The directory `file://` URLs may read under (symlinks resolved); None refuses them."""
    fetch_timeout_s: float = 5.0
    """The whole fetch (every hop, resolution, connect and body) must end within this."""
    max_media_bytes: int = 20 * 1024 * 1024
    """The most bytes one media item may have, decoded from base64 or read from a body."""
    max_redirects: int = 5
    """The most redirects one http(s) fetch follows."""
    allow_private_addresses: bool = False
    """Let http(s) fetches reach loopback, private, link-local and other non-public
    addresses (for an operator's own image store, or tests)."""
    allowed_private_networks: tuple[str, ...] = ()
    """Non-public networks allowed anyway, e.g. ("10.1.2.0/24",) for one internal image
    store, without opening every private address."""


def make_media_client(timeout_s: float, verify: ssl.SSLContext | bool = True) -> httpx.AsyncClient:
    """An HTTP client fit for `fetch_image_bytes`.

    Keep-alive is off because the pool is keyed by the connected address: a connection
    opened (and its certificate verified) for one host name must not be reused for another
    name that resolves to the same address. Proxy variables from the environment are
    ignored, since a proxy would connect to a name, not to the checked address.
    """
    return httpx.AsyncClient(
        follow_redirects=False,
        trust_env=False,
        timeout=httpx.Timeout(timeout_s),
        limits=httpx.Limits(max_keepalive_connections=0),
        verify=verify,
    )


async def fetch_image_bytes(
    url: str,
    policy: MediaPolicy,
    client: httpx.AsyncClient | None = None,
    resolver: Resolver | None = None,
) -> bytes:
    """The bytes `url` names, or MediaError saying why they may not or cannot be had.

    `client` defaults to a fresh `make_media_client` for this fetch; `resolver` to the
    event loop's getaddrinfo.
    """
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return decode_data_url(url, policy.max_media_bytes)
    if scheme == "file":
        return await read_file_url(url, policy)
    if scheme not in ("http", "https"):
        raise MediaError(f"media URL scheme {scheme or '(none)'!r} is not supported")
    try:
        async with asyncio.timeout(policy.fetch_timeout_s):
            if client is not None:
                return await fetch_http(url, policy, client, resolver or resolve_host)
            async with make_media_client(policy.fetch_timeout_s) as own:
                return await fetch_http(url, policy, own, resolver or resolve_host)
    except TimeoutError:
        raise MediaError(
            f"fetching the media URL timed out after {policy.fetch_timeout_s} s"
        ) from None
    except httpx.InvalidURL:
        raise MediaError("media URL (or a redirect's Location) is malformed") from None
    except httpx.HTTPError as exc:
        raise MediaError(f"fetching the media URL failed: {type(exc).__name__}") from exc


def decode_data_url(url: str, max_bytes: int) -> bytes:
    """The bytes of a `data:image/...;base64,...` URL, bounded before decoding."""
    header, sep, payload = url[len("data:") :].partition(",")
    if not sep:
        raise MediaError("data URL has no ',' before its data")
    media_type, *params = header.split(";")
    if not media_type.strip().lower().startswith("image/"):
        raise MediaError(f"data URL media type {media_type!r} is not an image type")
    if "base64" not in (p.strip().lower() for p in params):
        raise MediaError("data URL is not base64-encoded")
    payload = "".join(payload.split())
    # Every 4 base64 characters carry 3 bytes: refuse before decoding (and allocating) it.
    if len(payload) // 4 * 3 > max_bytes + 3:
        raise MediaError(f"data URL is larger than the limit of {max_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("data URL's base64 data is malformed") from None
    if len(data) > max_bytes:
        raise MediaError(f"data URL is larger than the limit of {max_bytes} bytes")
    return data


async def read_file_url(url: str, policy: MediaPolicy) -> bytes:
    """The bytes of a `file://` URL under `allowed_local_media_path`, read off the loop."""
    if policy.allowed_local_media_path is None:
        raise MediaError("file:// media URLs are not allowed (no --allowed-local-media-path)")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(f"file:// URL names a host ({parts.netloc!r}); only local files")
    return await asyncio.to_thread(
        read_local_file,
        Path(unquote(parts.path)),
        policy.allowed_local_media_path,
        policy.max_media_bytes,
    )


def read_local_file(path: Path, root: Path, max_bytes: int) -> bytes:
    """`path`'s bytes if, symlinks resolved, it is a regular file under `root`."""
    try:
        resolved = path.resolve(strict=True)
    except (OSError, RuntimeError):
        raise MediaError("file:// URL names no readable file") from None
    if not resolved.is_relative_to(root.resolve()):
        raise MediaError("file:// URL is outside the allowed local media path")
    try:
        # O_NOFOLLOW: a symlink swapped in for the checked file after resolving is refused.
        fd = os.open(resolved, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        raise MediaError("file:// URL names no readable file") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise MediaError("file:// URL does not name a regular file")
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise MediaError(f"file is larger than the limit of {max_bytes} bytes")
    return data


async def resolve_host(host: str, port: int) -> list[str]:
    """Every address `host` resolves to, once, through the event loop's resolver."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise MediaError(f"media URL host {host!r} does not resolve") from None
    return [str(info[4][0]) for info in infos]


def is_address_allowed(address: IPAddress, policy: MediaPolicy) -> bool:
    """Whether a fetch may connect to `address`: public, or allowed by the operator."""
    if policy.allow_private_addresses:
        return True
    if any(
        address in ipaddress.ip_network(n, strict=False) for n in policy.allowed_private_networks
    ):
        return True
    return all(is_public(a) for a in embedded_addresses(address))


def embedded_addresses(address: IPAddress) -> list[IPAddress]:
    """`address` and any IPv4 address it carries (mapped, 6to4, Teredo), all to be public."""
    found: list[IPAddress] = [address]
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            found.append(address.ipv4_mapped)
        if address.sixtofour is not None:
            found.append(address.sixtofour)
        if address.teredo is not None:
            found.extend(address.teredo)
    return found


def is_public(address: IPAddress) -> bool:
    # is_global is False for loopback, private, link-local (the 169.254.169.254 metadata
    # endpoints), unspecified, shared (100.64/10), reserved, ::1, fc00::/7 and fe80::/10;
    # multicast is refused explicitly since some multicast ranges count as global.
    return address.is_global and not address.is_multicast


async def fetch_http(
    url: str, policy: MediaPolicy, client: httpx.AsyncClient, resolver: Resolver
) -> bytes:
    """Follow `url`'s redirects by hand, checking each hop, and read the final body."""
    current = httpx.URL(url)
    for _ in range(policy.max_redirects + 1):
        request = await pinned_request(current, policy, client, resolver)
        response = await client.send(request, stream=True, follow_redirects=False)
        try:
            location = response.headers.get("location")
            if response.status_code in REDIRECT_STATUSES and location:
                current = current.join(location)
                continue
            if response.status_code != 200:
                raise MediaError(f"media URL answered HTTP {response.status_code}")
            return await read_body(response, policy.max_media_bytes)
        finally:
            await response.aclose()
    raise MediaError(f"media URL redirected more than {policy.max_redirects} times")


async def pinned_request(
    url: httpx.URL, policy: MediaPolicy, client: httpx.AsyncClient, resolver: Resolver
) -> httpx.Request:
    """A GET of `url` sent to the address its host resolved to, once that was checked.

    The URL carries the checked address and the Host header the name; for https the
    `sni_hostname` extension makes httpcore send the name as SNI and verify the
    certificate against the name, not the address.
    """
    if url.scheme not in ("http", "https"):
        raise MediaError(f"media URL redirected to the unsupported scheme {url.scheme!r}")
    host = url.raw_host.decode("ascii").lower().rstrip(".")
    if not host:
        raise MediaError("media URL has no host")
    allowed = policy.allowed_media_domains
    if allowed is not None and host not in {d.lower().rstrip(".") for d in allowed}:
        raise MediaError(f"media URL host {host!r} is not in the allowed media domains")
    port = url.port or (443 if url.scheme == "https" else 80)
    # Content-Encoding is declined: a compressed body would be inflated past the byte limit
    # a chunk at a time; one sent anyway arrives raw and fails to decode as an image.
    headers = {"Accept-Encoding": "identity"}
    address, is_literal = await checked_address(host, port, policy, resolver)
    if is_literal:
        return client.build_request("GET", url, headers=headers)
    host_header = host if url.port is None else f"{host}:{url.port}"
    extensions = {"sni_hostname": host} if url.scheme == "https" else {}
    return client.build_request(
        "GET",
        url.copy_with(host=str(address)),
        headers={**headers, "Host": host_header},
        extensions=extensions,
    )


async def checked_address(
    host: str, port: int, policy: MediaPolicy, resolver: Resolver
) -> tuple[IPAddress, bool]:
    """The address to connect to for `host`, and whether `host` is that address literally.

    Every address a name resolves to must be allowed, so a name that answers with one
    public and one internal address is refused whichever one a connect would pick.
    """
    try:
        literal: IPAddress | None = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    names = [str(literal)] if literal is not None else await resolver(host, port)
    addresses = []
    for name in names:
        try:
            addresses.append(ipaddress.ip_address(name.split("%", 1)[0]))
        except ValueError:
            raise MediaError(f"media URL host {host!r} resolved to a bad address") from None
    if not addresses:
        raise MediaError(f"media URL host {host!r} does not resolve")
    for address in addresses:
        if not is_address_allowed(address, policy):
            raise MediaError(
                f"media URL host {host!r} resolves to the non-public address {address}"
            )
    return addresses[0], literal is not None


async def read_body(response: httpx.Response, max_bytes: int) -> bytes:
    """The response body, refused as soon as it passes `max_bytes` (declared or read)."""
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise MediaError(f"media is larger than the limit of {max_bytes} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_raw():
        size += len(chunk)
        if size > max_bytes:
            raise MediaError(f"media is larger than the limit of {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
