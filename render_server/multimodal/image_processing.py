"""What every model family's image processor shares: the result, the pixel maths, the hash.

transformers' PIL processors (`Qwen2VLImageProcessorPil`, `Gemma3ImageProcessorPil`) all
run the same steps after their own resize: the 8-bit image is rescaled in float64 and cast
to float32, then normalized in float32 as `(x - mean) / std`. Each output value therefore
depends only on one 8-bit input value and its channel, so the whole chain is a 256-entry
table per channel, built with the very same numpy operations: indexing it gives transformers'
float32 values bit for bit, at the cost of one gather per pixel instead of three passes.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from PIL import Image

# transformers' `BaseImageProcessor.rescale_factor`.
DEFAULT_RESCALE_FACTOR = 1 / 255


class ImageProcessorConfigError(ValueError):
    """A model's preprocessor config that this tier cannot process images for."""


@dataclass(frozen=True)
class PixelOptions:
    """The per-pixel steps after the resize: rescale, then normalize (both optional)."""

    do_rescale: bool
    """Multiply by `rescale_factor` (in float64, as transformers does)."""
    rescale_factor: float
    """Usually 1/255: 8-bit values into [0, 1]."""
    do_normalize: bool
    """Subtract `image_mean` and divide by `image_std`, per channel, in float32."""
    image_mean: tuple[float, float, float]
    """Per-channel mean, RGB order."""
    image_std: tuple[float, float, float]
    """Per-channel standard deviation, RGB order."""

    def lookup_table(self) -> npt.NDArray[np.float32]:
        """[3, 256] float32: the processed value of each 8-bit value, per channel."""
        values = np.arange(256, dtype=np.uint8)
        table = np.empty((3, 256), dtype=np.float32)
        for channel in range(3):
            column: npt.NDArray[Any] = values
            if self.do_rescale:
                column = (column.astype(np.float64) * self.rescale_factor).astype(np.float32)
            if self.do_normalize:
                column = column.astype(np.float32)  # normalize's own cast of integer input
                mean = np.float32(self.image_mean[channel])
                std = np.float32(self.image_std[channel])
                column = (column - mean) / std
            table[channel] = column
        return table


@dataclass(frozen=True)
class ProcessedImage:
    """One image made ready for the model: what the worker's vision encoder takes."""

    pixel_values: npt.NDArray[np.float32]
    """Qwen2-VL: [num_patches, C*T*P*P]; Gemma 3: [3, H, W]. Equal to transformers' output."""
    grid_thw: tuple[int, int, int] | None
    """Qwen2-VL's `image_grid_thw` row (1, h, w) in patches; None for fixed-size families."""
    num_placeholder_tokens: int
    """How many of the prompt's tokens carry this image's embeddings."""
    mm_hash: str
    """Hex digest identifying the processed pixels; equal pixels and options, equal hash."""
    resized: npt.NDArray[np.uint8]
    """[H, W, 3] the resized 8-bit image `pixel_values` is computed from (a compact form
    to send: the per-pixel steps are the table in `PixelOptions`)."""


def mean_std(value: Any, default: tuple[float, float, float]) -> tuple[float, float, float]:
    """A config's `image_mean` / `image_std`: a list of three, one number, or absent."""
    if value is None:
        return default
    if isinstance(value, int | float):
        return (float(value),) * 3
    values = tuple(float(v) for v in value)
    if len(values) != 3:
        raise ImageProcessorConfigError(f"expected 3 channel values, got {list(value)}")
    return values[0], values[1], values[2]


def option(config: Mapping[str, Any], key: str, default: Any) -> Any:
    """`config[key]`, with None meaning the class default (transformers' `_set_attributes`).

    transformers v5 keeps a few explicit nulls as None instead (Gemma 3's released
    `"do_convert_rgb": null`, whose None then fails on any non-RGB image); the default is
    what such a config means, and the only behaviour that works for every input.
    """
    value = config.get(key)
    return default if value is None else value


def pixel_options(
    config: Mapping[str, Any],
    mean: tuple[float, float, float],
    std: tuple[float, float, float],
) -> PixelOptions:
    """The rescale and normalize steps of a preprocessor config, with the family's defaults."""
    return PixelOptions(
        do_rescale=bool(option(config, "do_rescale", True)),
        rescale_factor=float(option(config, "rescale_factor", DEFAULT_RESCALE_FACTOR)),
        do_normalize=bool(option(config, "do_normalize", True)),
        image_mean=mean_std(config.get("image_mean"), mean),
        image_std=mean_std(config.get("image_std"), std),
    )


def resampling(value: Any, default: Image.Resampling) -> Image.Resampling:
    """A config's `resample` (PIL's integer codes, as transformers' enum uses) as PIL's."""
    if value is None:
        return default
    try:
        return Image.Resampling(int(value))
    except ValueError:
        raise ImageProcessorConfigError(f"unknown resample filter {value!r}") from None


def content_hash(family: str, options: Mapping[str, Any], resized: npt.NDArray[np.uint8]) -> str:
    """The hash of an image's processed pixels.

    `pixel_values` is a pure function of the resized 8-bit image and the options after the
    resize, so hashing those identifies it as well as hashing the float32 values would, over
    a quarter of the bytes (Qwen2-VL's temporal copies make it an eighth). The shape is in
    the options: two images of one byte string but different sizes differ.
    """
    digest = hashlib.blake2b(digest_size=32)
    header = {"family": family, "shape": list(resized.shape), "options": options}
    digest.update(json.dumps(header, sort_keys=True, separators=(",", ":")).encode())
    digest.update(np.ascontiguousarray(resized).tobytes())
    return digest.hexdigest()


class ImageProcessor(ABC):
    """A model family's image processor: a PIL image in, the model's pixel values out.

    `image_token` is the text the chat template writes for each image, and
    `replacement_text` what the prompt holds there once expanded, so the token count
    matches `num_placeholder_tokens` (transformers' processors expand the same way).
    """

    family: str
    image_token: str

    @abstractmethod
    def process(self, image: Image.Image) -> ProcessedImage:
        """Resize, rescale, normalize (and patchify) one image."""

    @abstractmethod
    def replacement_text(self, processed: ProcessedImage) -> str:
        """The prompt text that replaces one `image_token` for `processed`."""

    @abstractmethod
    def options(self) -> dict[str, Any]:
        """The options that change the processed pixels, as JSON-able values (for hashes)."""
