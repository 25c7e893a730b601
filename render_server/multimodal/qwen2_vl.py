"""Qwen2-VL's image processor (Qwen2.5-VL and Qwen3-VL use it too), without torch.

Equal to transformers' `Qwen2VLImageProcessorPil`: `smart_resize` picks a size whose sides
are multiples of `patch_size * merge_size` with a pixel count in [min_pixels, max_pixels],
PIL resizes the 8-bit RGB image to it, the pixels are rescaled and normalized, and the image
is cut into patches ordered merge window by merge window, each patch repeated
`temporal_patch_size` times (a still image is a video of identical frames to the encoder).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from PIL import Image

from render_server.multimodal.image_decode import to_rgb
from render_server.multimodal.image_processing import (
    ImageProcessor,
    ImageProcessorConfigError,
    PixelOptions,
    ProcessedImage,
    content_hash,
    option,
    pixel_options,
    resampling,
)

# transformers' OPENAI_CLIP_MEAN / OPENAI_CLIP_STD, the class defaults.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280
MAX_ASPECT_RATIO = 200


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """The (height, width) transformers resizes an image to: sides multiples of `factor`,
    area within [min_pixels, max_pixels], aspect ratio kept as closely as rounding allows."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"image aspect ratio must be at most {MAX_ASPECT_RATIO}, got {width}x{height}"
        )
    # Python's round() halves to even, as transformers' does; the arithmetic is kept in
    # its order so the float results (and so the sizes) are the same.
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class Qwen2VLConfig:
    """The fields of a Qwen2-VL `preprocessor_config.json` that change the output."""

    do_resize: bool
    """Resize with `smart_resize`; off, the image's sides must already be multiples of
    `patch_size * merge_size`."""
    min_pixels: int
    """`size.shortest_edge` (or the older `min_pixels`): the least resized area."""
    max_pixels: int
    """`size.longest_edge` (or `max_pixels`): the largest resized area."""
    resample: int
    """PIL's filter code; bicubic (3) by default."""
    patch_size: int
    """The vision encoder's patch side in pixels."""
    temporal_patch_size: int
    """Frames per patch; an image is repeated this many times."""
    merge_size: int
    """Patches merged per side into one LLM token."""
    pixels: PixelOptions
    """Rescale and normalize."""

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> Qwen2VLConfig:
        """The config as transformers' constructor reads it: `min_pixels` / `max_pixels`
        override `size`, and a None value means the class default."""
        size = option(config, "size", {})
        if not isinstance(size, Mapping):
            raise ImageProcessorConfigError(f"Qwen2-VL size must be a mapping, got {size!r}")
        min_pixels = option(
            config,
            "min_pixels",
            size.get("shortest_edge", size.get("min_pixels", DEFAULT_MIN_PIXELS)),
        )
        max_pixels = option(
            config,
            "max_pixels",
            size.get("longest_edge", size.get("max_pixels", DEFAULT_MAX_PIXELS)),
        )
        return cls(
            do_resize=bool(option(config, "do_resize", True)),
            min_pixels=int(min_pixels),
            max_pixels=int(max_pixels),
            resample=int(resampling(config.get("resample"), Image.Resampling.BICUBIC)),
            patch_size=int(option(config, "patch_size", 14)),
            temporal_patch_size=int(option(config, "temporal_patch_size", 2)),
            merge_size=int(option(config, "merge_size", 2)),
            pixels=pixel_options(config, CLIP_MEAN, CLIP_STD),
        )


class Qwen2VLImageProcessor(ImageProcessor):
    """Qwen2-VL's processor: pixel values [num_patches, C*T*P*P] and grid (1, h, w)."""

    family = "qwen2_vl"

    def __init__(self, config: Qwen2VLConfig, image_token: str = "<|image_pad|>") -> None:
        self.config = config
        self.image_token = image_token
        self._table = config.pixels.lookup_table()

    @property
    def factor(self) -> int:
        """The resized sides' common divisor: one merge window, in pixels."""
        return self.config.patch_size * self.config.merge_size

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) an image of this size is processed at."""
        if not self.config.do_resize:
            return width, height
        h, w = smart_resize(
            height, width, self.factor, self.config.min_pixels, self.config.max_pixels
        )
        return w, h

    def num_placeholder_tokens(self, width: int, height: int) -> int:
        """Tokens an image of this size takes, without processing it (for `/tokenize`)."""
        w, h = self.resized_size(width, height)
        merge = self.config.merge_size
        return (h // self.config.patch_size) * (w // self.config.patch_size) // (merge * merge)

    def process(self, image: Image.Image) -> ProcessedImage:
        cfg = self.config
        rgb = to_rgb(image)
        size = self.resized_size(*rgb.size)
        if cfg.do_resize:
            # transformers resizes even when the size is unchanged; PIL then copies.
            rgb = rgb.resize(size, resample=Image.Resampling(cfg.resample))
        width, height = size
        if height % self.factor or width % self.factor:
            raise ValueError(f"image is {width}x{height}, not a multiple of {self.factor}")
        resized = np.asarray(rgb, dtype=np.uint8)
        p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
        grid_h, grid_w = height // p, width // p
        # [H, W, C] -> [gh/m, gw/m, m, m, C, P, P]: transformers' patch order, its channels
        # first, moved while still one byte per value.
        windows = resized.reshape(grid_h // m, m, p, grid_w // m, m, p, 3)
        windows = windows.transpose(0, 3, 1, 4, 6, 2, 5)
        channel = np.arange(3).reshape(3, 1, 1)
        patches = self._table[channel, windows]
        frames = np.broadcast_to(patches[..., None, :, :], (*patches.shape[:5], t, p, p))
        pixel_values = np.ascontiguousarray(frames.reshape(grid_h * grid_w, 3 * t * p * p))
        return ProcessedImage(
            pixel_values=pixel_values,
            grid_thw=(1, grid_h, grid_w),
            num_placeholder_tokens=grid_h * grid_w // (m * m),
            mm_hash=content_hash(self.family, self.options(), resized),
            resized=resized,
        )

    def replacement_text(self, processed: ProcessedImage) -> str:
        return self.image_token * processed.num_placeholder_tokens

    def options(self) -> dict[str, Any]:
        # The resize options are in the hashed image's shape; the rest change values or
        # their layout.
        options = asdict(self.config)
        for key in ("do_resize", "min_pixels", "max_pixels", "resample"):
            del options[key]
        return options
