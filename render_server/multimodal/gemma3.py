"""Gemma 3's image processor (SigLIP's), without torch.

Equal to transformers' `Gemma3ImageProcessorPil` without pan-and-scan: PIL resizes the RGB
image to the fixed `size` (896x896 for the released models, aspect ratio not kept), then
the pixels are rescaled and normalized (mean and std 0.5: values in [-1, 1]). The encoder
pools each image into `image_seq_length` soft tokens, which the prompt holds between a
begin-of-image and an end-of-image token.
"""

from __future__ import annotations

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

# transformers' IMAGENET_STANDARD_MEAN / _STD, the class defaults.
STANDARD_MEAN = (0.5, 0.5, 0.5)
STANDARD_STD = (0.5, 0.5, 0.5)
DEFAULT_SIZE = 224
DEFAULT_IMAGE_SEQ_LENGTH = 256


@dataclass(frozen=True)
class Gemma3Config:
    """The fields of a Gemma 3 `preprocessor_config.json` that change the output."""

    do_resize: bool
    """Resize to `height` x `width`; off, images must all be one size to batch."""
    height: int
    """Target height in pixels (`size.height`)."""
    width: int
    """Target width in pixels (`size.width`)."""
    resample: int
    """PIL's filter code; bilinear (2) by default."""
    pixels: PixelOptions
    """Rescale and normalize."""
    image_seq_length: int
    """Soft tokens per image (`processor_config.json`'s `image_seq_length`, or the model
    config's `mm_tokens_per_image`)."""

    @classmethod
    def from_dict(
        cls, config: Mapping[str, Any], image_seq_length: int = DEFAULT_IMAGE_SEQ_LENGTH
    ) -> Gemma3Config:
        """The config as transformers reads it; a None value means the class default."""
        if option(config, "do_pan_and_scan", False):
            raise ImageProcessorConfigError("Gemma 3's pan-and-scan is not supported")
        size = option(config, "size", DEFAULT_SIZE)
        if isinstance(size, int):
            height = width = size
        elif isinstance(size, Mapping) and "height" in size and "width" in size:
            height, width = int(size["height"]), int(size["width"])
        else:
            raise ImageProcessorConfigError(f"Gemma 3 size must be height and width: {size!r}")
        return cls(
            do_resize=bool(option(config, "do_resize", True)),
            height=height,
            width=width,
            resample=int(resampling(config.get("resample"), Image.Resampling.BILINEAR)),
            pixels=pixel_options(config, STANDARD_MEAN, STANDARD_STD),
            image_seq_length=int(option(config, "image_seq_length", image_seq_length)),
        )


class Gemma3ImageProcessor(ImageProcessor):
    """Gemma 3's processor: pixel values [3, height, width] and `image_seq_length` tokens."""

    family = "gemma3"

    def __init__(
        self,
        config: Gemma3Config,
        boi_token: str = "<start_of_image>",
        image_soft_token: str = "<image_soft_token>",
        eoi_token: str = "<end_of_image>",
    ) -> None:
        self.config = config
        # Gemma 3's chat template writes the begin-of-image token for each image.
        self.image_token = boi_token
        self._sequence = (
            f"\n\n{boi_token}{image_soft_token * config.image_seq_length}{eoi_token}\n\n"
        )
        self._table = config.pixels.lookup_table()

    def num_placeholder_tokens(self, width: int, height: int) -> int:
        """Tokens an image takes, whatever its size (the soft tokens, without begin/end)."""
        return self.config.image_seq_length

    def process(self, image: Image.Image) -> ProcessedImage:
        cfg = self.config
        rgb = to_rgb(image)
        if cfg.do_resize:
            rgb = rgb.resize((cfg.width, cfg.height), resample=Image.Resampling(cfg.resample))
        resized = np.asarray(rgb, dtype=np.uint8)
        channel = np.arange(3).reshape(3, 1, 1)
        pixel_values = self._table[channel, resized.transpose(2, 0, 1)]
        return ProcessedImage(
            pixel_values=pixel_values,
            grid_thw=None,
            num_placeholder_tokens=cfg.image_seq_length,
            mm_hash=content_hash(self.family, self.options(), resized),
            resized=resized,
        )

    def replacement_text(self, processed: ProcessedImage) -> str:
        """transformers' `full_image_sequence`: blank lines, begin, soft tokens, end."""
        return self._sequence

    def options(self) -> dict[str, Any]:
        # The resize options are in the hashed image's shape; the token count is not a
        # pixel option but changes what the image stands for in the prompt.
        options = asdict(self.config)
        for key in ("do_resize", "height", "width", "resample"):
            del options[key]
        return options
