"""The image processor a model directory calls for, or None for a text-only model.

The family is read as transformers reads it: `image_processor_type` in
`preprocessor_config.json` (transformers v5 may nest it as `image_processor` inside
`processor_config.json`), its `Fast` / `Pil` variants being the same maths, and failing
that the model config's `model_type`. A model whose config has a vision part this tier has
no processor for is an error, not None: answering "does not accept images" would be wrong.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from render_server.multimodal.gemma3 import (
    DEFAULT_IMAGE_SEQ_LENGTH,
    Gemma3Config,
    Gemma3ImageProcessor,
)
from render_server.multimodal.image_processing import ImageProcessor, ImageProcessorConfigError
from render_server.multimodal.qwen2_vl import Qwen2VLConfig, Qwen2VLImageProcessor

PREPROCESSOR_CONFIG = "preprocessor_config.json"
PROCESSOR_CONFIG = "processor_config.json"
MODEL_CONFIG = "config.json"


def qwen2_vl(
    config: Mapping[str, Any], processor: Mapping[str, Any], model: Mapping[str, Any]
) -> ImageProcessor:
    """Qwen2-VL's processor from its configs."""
    return Qwen2VLImageProcessor(Qwen2VLConfig.from_dict(config))


def gemma3(
    config: Mapping[str, Any], processor: Mapping[str, Any], model: Mapping[str, Any]
) -> ImageProcessor:
    """Gemma 3's processor; its token count lives in the processor or model config."""
    seq_length = processor.get("image_seq_length") or model.get("mm_tokens_per_image")
    return Gemma3ImageProcessor(
        Gemma3Config.from_dict(config, int(seq_length or DEFAULT_IMAGE_SEQ_LENGTH))
    )


Builder = Callable[[Mapping[str, Any], Mapping[str, Any], Mapping[str, Any]], ImageProcessor]
# image_processor_type without its Fast / Pil suffix -> builder.
BY_PROCESSOR_TYPE: dict[str, Builder] = {
    "Qwen2VLImageProcessor": qwen2_vl,
    "Gemma3ImageProcessor": gemma3,
}
# model_type -> builder, for configs without an image_processor_type.
BY_MODEL_TYPE: dict[str, Builder] = {
    "qwen2_vl": qwen2_vl,
    "qwen2_5_vl": qwen2_vl,
    "qwen3_vl": qwen2_vl,
    "qwen3_vl_moe": qwen2_vl,
    "gemma3": gemma3,
}


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file's contents; {} when the file is absent."""
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ImageProcessorConfigError(f"{path.name} is not a JSON object")
    return data


def processor_type(config: Mapping[str, Any]) -> str | None:
    """`image_processor_type` with transformers' backend suffixes stripped."""
    name = config.get("image_processor_type")
    if not isinstance(name, str):
        return None
    for suffix in ("Fast", "Pil"):
        name = name.removesuffix(suffix)
    return name


def load_image_processor(model_dir: str | Path) -> ImageProcessor | None:
    """The image processor for the model in `model_dir`, or None when it takes no images.

    Raises ImageProcessorConfigError for a vision model of an unsupported family or
    processor option (pan-and-scan), and for malformed config files.
    """
    root = Path(model_dir)
    try:
        preprocessor = read_json(root / PREPROCESSOR_CONFIG)
        processor = read_json(root / PROCESSOR_CONFIG)
        model = read_json(root / MODEL_CONFIG)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ImageProcessorConfigError(f"cannot read {model_dir}'s configs: {exc}") from exc
    nested = processor.get("image_processor")
    config = preprocessor or (nested if isinstance(nested, dict) else {})
    name = processor_type(config)
    if name in BY_PROCESSOR_TYPE:
        return BY_PROCESSOR_TYPE[name](config, processor, model)
    model_type = model.get("model_type")
    if isinstance(model_type, str) and model_type in BY_MODEL_TYPE:
        return BY_MODEL_TYPE[model_type](config, processor, model)
    if name is not None or "vision_config" in model:
        raise ImageProcessorConfigError(
            f"no image processor for {name or model_type!r} on the render tier"
        )
    return None
