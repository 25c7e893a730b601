"""Decoding an image's bytes into an upright RGB Pillow image, safely and off the event loop.

The bytes come from a client, so the decoder is hostile-input code: the size is checked
from the header before any pixel is decoded (a decompression bomb declares a huge size in a
small file), only the common raster formats are tried (Pillow's EPS plugin, for one, runs
Ghostscript), and whatever Pillow raises becomes a MediaError naming the problem.
"""

from __future__ import annotations

import asyncio
import io
from concurrent.futures import ThreadPoolExecutor

from PIL import Image, ImageOps

from render_server.multimodal.media_error import MediaError

# JPEG's opener also opens MPO, the JPEG-with-previews many phone cameras write.
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
# The background transparent pixels are composited over: transformers' `convert_to_rgb`
# and vLLM use white, so the processed pixels match theirs.
ALPHA_BACKGROUND = (255, 255, 255)


def decode_image(data: bytes, max_image_pixels: int) -> Image.Image:
    """`data` as an RGB image, EXIF orientation applied, first frame of an animation.

    Raises MediaError, and nothing else, for empty or non-image data, an unsupported format,
    a 0x0 image, more than `max_image_pixels` pixels, or a truncated or corrupt file.
    Pillow's process-wide `Image.MAX_IMAGE_PIXELS` bomb check still applies on top.
    """
    if not data:
        raise MediaError("image data is empty")
    # open(formats=...) looks the names up among the loaded plugins, and WebP's and TIFF's
    # load only in init() (a no-op once done).
    Image.init()
    try:
        # open() reads the header only; the pixels are decoded by load(), after the checks.
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError:
        raise MediaError("image has too many pixels") from None
    except Exception:  # Pillow's plugins raise OSError, SyntaxError, struct.error and more
        raise MediaError("data is not an image in a supported format") from None
    width, height = image.size
    if width <= 0 or height <= 0:
        raise MediaError(f"image is empty ({width}x{height})")
    if width * height > max_image_pixels:
        raise MediaError(
            f"image is {width}x{height}, more than the limit of {max_image_pixels} pixels"
        )
    try:
        image.seek(0)
        image.load()
        upright = ImageOps.exif_transpose(image)
        return to_rgb(upright)
    except Exception:  # a truncated or corrupt body fails only here, in the decoder
        raise MediaError(f"image ({image.format}) is truncated or corrupt") from None


def to_rgb(image: Image.Image) -> Image.Image:
    """`image` in RGB; transparency composited over white, as transformers'
    `convert_to_rgb` does. The image processors apply it too, whatever `do_convert_rgb`
    says: every encoder here takes three channels."""
    if image.mode == "RGB":
        return image
    with_alpha = image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "A" in image.getbands()
    if with_alpha or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (*ALPHA_BACKGROUND, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def make_decode_executor(max_workers: int) -> ThreadPoolExecutor:
    """The bounded pool images are decoded in; Pillow's decoders release the GIL, so its
    threads decode in parallel with the event loop's thread."""
    return ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="image-decode")


async def decode_image_async(
    data: bytes, max_image_pixels: int, executor: ThreadPoolExecutor
) -> Image.Image:
    """`decode_image` in `executor`, so a large image does not stall other coroutines."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(executor, decode_image, data, max_image_pixels)
