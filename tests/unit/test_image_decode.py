"""decode_image on images made here with Pillow: formats, EXIF orientation, RGB conversion,
first frames, and hostile bytes (truncated, random, bombs) that must be MediaError only."""

from __future__ import annotations

import asyncio
import io
import os
import struct
import threading
import time
import zlib

import pytest
from PIL import Image

from render_server.multimodal import image_decode
from render_server.multimodal.image_decode import (
    decode_image,
    decode_image_async,
    make_decode_executor,
)
from render_server.multimodal.media_error import MediaError

pytestmark = pytest.mark.timeout(30)

LIMIT = 10_000_000
RED, BLUE = (255, 0, 0), (0, 0, 255)


def encode(image: Image.Image, fmt: str, **options: object) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **options)
    return out.getvalue()


# Noise compresses badly, so a cut lands in the pixel data, well past the headers.
NOISY_JPEG = encode(Image.effect_noise((256, 256), 64).convert("RGB"), "JPEG")


def halves(size: tuple[int, int] = (40, 20)) -> Image.Image:
    """Left half red, right half blue: which way it ends up shows the orientation."""
    image = Image.new("RGB", size, BLUE)
    image.paste(RED, (0, 0, size[0] // 2, size[1]))
    return image


def near(pixel: object, color: tuple[int, int, int], tolerance: int = 40) -> bool:
    assert isinstance(pixel, tuple)
    return all(abs(a - b) <= tolerance for a, b in zip(pixel[:3], color, strict=True))


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"])
def test_each_format_decodes_to_rgb_at_its_size(fmt: str) -> None:
    image = decode_image(encode(halves((33, 17)), fmt), LIMIT)
    assert (image.mode, image.size) == ("RGB", (33, 17))
    assert near(image.getpixel((2, 8)), RED)
    assert near(image.getpixel((30, 8)), BLUE)


def test_an_exif_orientation_is_applied() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # the camera was turned: display rotated 90 degrees clockwise
    image = decode_image(encode(halves(), "JPEG", exif=exif.tobytes()), LIMIT)
    assert image.size == (20, 40)
    # Clockwise, the left (red) half becomes the top.
    assert near(image.getpixel((10, 2)), RED)
    assert near(image.getpixel((10, 37)), BLUE)


@pytest.mark.parametrize(
    ("image", "fmt"),
    [
        (Image.new("RGBA", (8, 8), (0, 0, 0, 0)), "PNG"),
        (Image.new("LA", (8, 8), (0, 0)), "PNG"),
        (Image.new("P", (8, 8), 0), "GIF"),  # palette entry 0 made transparent below
    ],
)
def test_transparency_is_composited_over_white(image: Image.Image, fmt: str) -> None:
    options = {"transparency": 0} if image.mode == "P" else {}
    decoded = decode_image(encode(image, fmt, **options), LIMIT)
    assert decoded.mode == "RGB"
    assert decoded.getpixel((4, 4)) == (255, 255, 255)


@pytest.mark.parametrize(
    ("image", "fmt", "expected"),
    [
        (Image.new("L", (8, 8), 128), "PNG", (128, 128, 128)),
        (Image.new("CMYK", (8, 8), (0, 255, 255, 0)), "JPEG", RED),
        (Image.new("I;16", (8, 8), 0), "PNG", (0, 0, 0)),
        (Image.new("1", (8, 8), 1), "PNG", (255, 255, 255)),
    ],
)
def test_other_modes_convert_to_rgb(
    image: Image.Image, fmt: str, expected: tuple[int, int, int]
) -> None:
    decoded = decode_image(encode(image, fmt), LIMIT)
    assert decoded.mode == "RGB"
    assert near(decoded.getpixel((4, 4)), expected, tolerance=8)


@pytest.mark.parametrize("fmt", ["GIF", "WEBP"])
def test_an_animation_gives_its_first_frame(fmt: str) -> None:
    frames = [Image.new("RGB", (16, 16), RED), Image.new("RGB", (16, 16), BLUE)]
    data = encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=100)
    assert getattr(Image.open(io.BytesIO(data)), "n_frames", 1) == 2
    assert near(decode_image(data, LIMIT).getpixel((8, 8)), RED)


def png_declaring(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height over a few bytes of (bogus) pixel data."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body)
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    pixels = zlib.compress(b"\0" * 64)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")
    )


def test_a_decompression_bomb_is_refused_from_its_header_quickly() -> None:
    start = time.monotonic()
    with pytest.raises(MediaError, match="3000x3000, more than the limit of 1000000 pixels"):
        decode_image(png_declaring(3000, 3000), 1_000_000)
    # Past Pillow's own process-wide limit too: still a MediaError, not its exception.
    with pytest.raises(MediaError, match="too many pixels"):
        decode_image(png_declaring(100_000, 100_000), LIMIT)
    with pytest.raises(MediaError, match="more than the limit"):
        decode_image(encode(halves((40, 20)), "JPEG"), 799)
    assert time.monotonic() - start < 1.0


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "empty"),
        (os.urandom(4096), "not an image"),
        (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", "not an image"),
        (b"<svg xmlns='http://www.w3.org/2000/svg' width='10' height='10'/>", "not an image"),
        (png_declaring(0, 0), "empty|not an image"),
        (png_declaring(16, 16), "truncated or corrupt"),
        (NOISY_JPEG[: len(NOISY_JPEG) * 2 // 3], "truncated or corrupt"),
        (encode(halves((64, 64)), "PNG")[:-30], "truncated or corrupt"),
    ],
    ids=["empty", "random", "eps", "svg", "zero-size", "short-pixels", "cut-jpeg", "cut-png"],
)
def test_bad_bytes_are_a_media_error_only(data: bytes, message: str) -> None:
    with pytest.raises(MediaError, match=message):
        decode_image(data, LIMIT)


def test_decoding_runs_in_the_pool_while_the_event_loop_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The decode blocks until a coroutine on the loop releases it: were it run on the
    # loop's thread, the release could never happen and the wait would time out.
    released = threading.Event()
    threads: list[str] = []

    def blocking_decode(data: bytes, max_image_pixels: int) -> Image.Image:
        threads.append(threading.current_thread().name)
        assert released.wait(timeout=5)
        return decode_image(data, max_image_pixels)

    monkeypatch.setattr(image_decode, "decode_image", blocking_decode)

    async def main() -> Image.Image:
        with make_decode_executor(2) as executor:
            task = asyncio.create_task(decode_image_async(encode(halves(), "PNG"), LIMIT, executor))
            await asyncio.sleep(0.01)
            released.set()
            return await asyncio.wait_for(task, timeout=5)

    assert asyncio.run(main()).size == (40, 20)
    assert threads[0].startswith("image-decode")


def test_a_bad_image_in_the_pool_is_a_media_error() -> None:
    async def main() -> None:
        with make_decode_executor(1) as executor:
            with pytest.raises(MediaError, match="not an image"):
                await decode_image_async(b"not an image", LIMIT, executor)
            assert (await decode_image_async(encode(halves(), "PNG"), LIMIT, executor)).size

    asyncio.run(main())
