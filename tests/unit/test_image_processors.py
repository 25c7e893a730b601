"""The render tier's image processors against transformers' own PIL processors.

Each family's pixel values must equal transformers' bit for bit (the same PIL resize, then
the same float64/float32 operations), for odd, tiny and large images and for images that
need converting to RGB; grids, placeholder counts, hashes and the loader are checked too.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from render_server.multimodal.gemma3 import Gemma3Config, Gemma3ImageProcessor
from render_server.multimodal.image_processing import ImageProcessorConfigError
from render_server.multimodal.image_processors import load_image_processor
from render_server.multimodal.qwen2_vl import Qwen2VLConfig, Qwen2VLImageProcessor, smart_resize

qwen2_vl_pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
gemma3_pil = pytest.importorskip("transformers.models.gemma3.image_processing_pil_gemma3")

# Qwen2-VL-7B-Instruct's preprocessor_config.json (the older min/max_pixels form).
QWEN2_VL = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
}
# Qwen3-VL's: the size form, 16-pixel patches, mean and std 0.5, a small max_pixels here
# so the large image is scaled down by smart_resize's max branch.
QWEN3_VL = {
    "size": {"shortest_edge": 65536, "longest_edge": 200_000},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_convert_rgb": True,
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
# gemma-3-4b-it's preprocessor_config.json.
GEMMA3 = {
    "do_convert_rgb": None,
    "do_normalize": True,
    "do_pan_and_scan": None,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "Gemma3ImageProcessor",
    "image_seq_length": 256,
    "image_std": [0.5, 0.5, 0.5],
    "pan_and_scan_max_num_crops": None,
    "pan_and_scan_min_crop_size": None,
    "pan_and_scan_min_ratio_to_activate": None,
    "processor_class": "Gemma3Processor",
    "resample": 2,
    "rescale_factor": 0.00392156862745098,
    "size": {"height": 896, "width": 896},
}
NOT_KWARGS = ("image_processor_type", "processor_class", "image_seq_length")


def hf_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in NOT_KWARGS}


def noise(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """A random image: every pixel differs, so any resize or order mistake shows."""
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    rng = np.random.default_rng(seed + width * 7919 + height)
    data = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(data[..., 0] if mode == "L" else data, mode)


def palette_with_transparency() -> Image.Image:
    image = noise(41, 23).convert("P")
    image.info["transparency"] = 0
    return image


SIZES = [(333, 517), (28, 28), (1, 1), (1920, 1080), (517, 33)]
MODES = ["RGBA", "L"]


@pytest.mark.parametrize("config", [QWEN2_VL, QWEN3_VL], ids=["qwen2_vl", "qwen3_vl"])
@pytest.mark.parametrize(("width", "height"), SIZES)
def test_qwen2_vl_equals_transformers(config: dict[str, Any], width: int, height: int) -> None:
    image = noise(width, height)
    reference = qwen2_vl_pil.Qwen2VLImageProcessorPil(**hf_kwargs(config))
    expected = reference(image, return_tensors="np")
    processor = Qwen2VLImageProcessor(Qwen2VLConfig.from_dict(config))
    got = processor.process(image)
    assert got.pixel_values.dtype == np.float32
    np.testing.assert_array_equal(got.pixel_values, expected["pixel_values"])
    assert got.grid_thw == tuple(expected["image_grid_thw"][0])
    merge = config["merge_size"]
    assert got.num_placeholder_tokens == int(expected["image_grid_thw"][0].prod()) // merge**2
    assert processor.num_placeholder_tokens(width, height) == got.num_placeholder_tokens
    assert got.num_placeholder_tokens == reference.get_number_of_image_patches(height, width) // 4
    assert processor.replacement_text(got) == "<|image_pad|>" * got.num_placeholder_tokens


@pytest.mark.parametrize(
    "image",
    [noise(97, 61, "RGBA"), noise(97, 61, "L"), palette_with_transparency()],
    ids=["rgba", "l", "p-transparency"],
)
def test_qwen2_vl_converts_to_rgb_as_transformers(image: Image.Image) -> None:
    expected = qwen2_vl_pil.Qwen2VLImageProcessorPil(**hf_kwargs(QWEN2_VL))(
        image, return_tensors="np"
    )
    got = Qwen2VLImageProcessor(Qwen2VLConfig.from_dict(QWEN2_VL)).process(image)
    np.testing.assert_array_equal(got.pixel_values, expected["pixel_values"])


@pytest.mark.parametrize(
    "overrides",
    [
        {"do_normalize": False},
        {"do_rescale": False},
        {"resample": 1, "rescale_factor": 0.5},
        {
            "size": {"min_pixels": 50_000, "max_pixels": 100_000},
            "min_pixels": None,
            "max_pixels": None,
        },
    ],
    ids=["no-normalize", "no-rescale", "lanczos", "size-min-max-keys"],
)
def test_qwen2_vl_options_equal_transformers(overrides: dict[str, Any]) -> None:
    config = {**QWEN2_VL, **overrides}
    if "size" in overrides:
        # transformers reads the older keys only as arguments, not inside `size`.
        config = {**QWEN2_VL, "min_pixels": 50_000, "max_pixels": 100_000}
    image = noise(333, 517)
    expected = qwen2_vl_pil.Qwen2VLImageProcessorPil(**hf_kwargs(config))(
        image, return_tensors="np"
    )
    got = Qwen2VLImageProcessor(Qwen2VLConfig.from_dict({**QWEN2_VL, **overrides})).process(image)
    np.testing.assert_array_equal(got.pixel_values, expected["pixel_values"].astype(np.float32))


@pytest.mark.parametrize(
    ("height", "width"), [(1, 1), (28, 28), (517, 333), (1080, 1920), (3, 599), (2000, 11)]
)
def test_smart_resize_equals_transformers(height: int, width: int) -> None:
    for factor, low, high in [(28, 3136, 12845056), (32, 65536, 200_000)]:
        expected = qwen2_vl_pil.smart_resize(height, width, factor, low, high)
        assert smart_resize(height, width, factor, low, high) == expected


def test_smart_resize_refuses_extreme_aspect_ratio() -> None:
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 201, 28, 3136, 12845056)


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_gemma3_equals_transformers(width: int, height: int) -> None:
    image = noise(width, height)
    expected = gemma3_pil.Gemma3ImageProcessorPil(**hf_kwargs(GEMMA3))(image, return_tensors="np")
    processor = Gemma3ImageProcessor(Gemma3Config.from_dict(GEMMA3))
    got = processor.process(image)
    assert got.pixel_values.shape == (3, 896, 896)
    assert got.pixel_values.dtype == np.float32
    np.testing.assert_array_equal(got.pixel_values, expected["pixel_values"][0])
    assert got.grid_thw is None
    assert got.num_placeholder_tokens == 256
    text = processor.replacement_text(got)
    assert text == "\n\n<start_of_image>" + "<image_soft_token>" * 256 + "<end_of_image>\n\n"


@pytest.mark.parametrize("mode", MODES)
def test_gemma3_converts_to_rgb_as_transformers(mode: str) -> None:
    image = noise(97, 61, mode)
    # The released config's explicit `"do_convert_rgb": null` stays None in transformers v5,
    # which then fails on non-RGB images; its class default (True) is what it means.
    config = {**hf_kwargs(GEMMA3), "do_convert_rgb": True}
    expected = gemma3_pil.Gemma3ImageProcessorPil(**config)(image, return_tensors="np")
    got = Gemma3ImageProcessor(Gemma3Config.from_dict(GEMMA3)).process(image)
    np.testing.assert_array_equal(got.pixel_values, expected["pixel_values"][0])


@pytest.mark.parametrize("image_format", ["PNG", "JPEG", "WEBP"])
def test_image_files_equal_transformers(image_format: str) -> None:
    """Images as they arrive: encoded, then opened lazily by Pillow (JPEG's YCbCr too)."""
    buffer = io.BytesIO()
    noise(301, 199).save(buffer, format=image_format)
    image = Image.open(io.BytesIO(buffer.getvalue()))
    qwen = qwen2_vl_pil.Qwen2VLImageProcessorPil(**hf_kwargs(QWEN2_VL))(image, return_tensors="np")
    got = Qwen2VLImageProcessor(Qwen2VLConfig.from_dict(QWEN2_VL)).process(image)
    np.testing.assert_array_equal(got.pixel_values, qwen["pixel_values"])
    gemma = gemma3_pil.Gemma3ImageProcessorPil(**hf_kwargs(GEMMA3))(image, return_tensors="np")
    got = Gemma3ImageProcessor(Gemma3Config.from_dict(GEMMA3)).process(image)
    np.testing.assert_array_equal(got.pixel_values, gemma["pixel_values"][0])


def test_gemma3_refuses_pan_and_scan() -> None:
    with pytest.raises(ImageProcessorConfigError, match="pan-and-scan"):
        Gemma3Config.from_dict({**GEMMA3, "do_pan_and_scan": True})


def test_hashes_are_stable_and_distinct() -> None:
    qwen = Qwen2VLImageProcessor(Qwen2VLConfig.from_dict(QWEN2_VL))
    gemma = Gemma3ImageProcessor(Gemma3Config.from_dict(GEMMA3))
    first, second = noise(64, 48, seed=1), noise(64, 48, seed=2)
    for processor in (qwen, gemma):
        a = processor.process(first).mm_hash
        assert a == processor.process(first.copy()).mm_hash
        assert len(a) == 64
        assert a != processor.process(second).mm_hash
    # The same image under another family, or options that change the values, differs.
    assert qwen.process(first).mm_hash != gemma.process(first).mm_hash
    other_mean = Qwen2VLImageProcessor(Qwen2VLConfig.from_dict({**QWEN2_VL, "image_mean": 0.5}))
    assert qwen.process(first).mm_hash != other_mean.process(first).mm_hash
    # A fresh processor (and so a fresh process) hashes the same: nothing run-dependent.
    again = Qwen2VLImageProcessor(Qwen2VLConfig.from_dict(dict(QWEN2_VL)))
    assert again.process(first).mm_hash == qwen.process(first).mm_hash


def write_model(root: Path, files: dict[str, dict[str, Any]]) -> Path:
    for name, content in files.items():
        (root / name).write_text(json.dumps(content))
    return root


def test_loader_picks_the_family(tmp_path: Path) -> None:
    qwen_dir = tmp_path / "qwen"
    qwen_dir.mkdir()
    write_model(
        qwen_dir,
        {"preprocessor_config.json": QWEN3_VL, "config.json": {"model_type": "qwen3_vl"}},
    )
    qwen = load_image_processor(qwen_dir)
    assert isinstance(qwen, Qwen2VLImageProcessor)
    assert qwen.config.patch_size == 16
    assert qwen.config.max_pixels == 200_000

    gemma_dir = tmp_path / "gemma"
    gemma_dir.mkdir()
    gemma_config = {k: v for k, v in GEMMA3.items() if k != "image_seq_length"}
    write_model(
        gemma_dir,
        {
            "preprocessor_config.json": gemma_config,
            "processor_config.json": {"image_seq_length": 64},
            "config.json": {"model_type": "gemma3", "mm_tokens_per_image": 256},
        },
    )
    gemma = load_image_processor(gemma_dir)
    assert isinstance(gemma, Gemma3ImageProcessor)
    assert gemma.config.image_seq_length == 64
    assert (gemma.config.height, gemma.config.width) == (896, 896)


def test_loader_reads_model_type_and_nested_processor_config(tmp_path: Path) -> None:
    nested = {"image_processor": {**QWEN2_VL, "image_processor_type": None}}
    write_model(
        tmp_path, {"processor_config.json": nested, "config.json": {"model_type": "qwen2_5_vl"}}
    )
    qwen = load_image_processor(tmp_path)
    assert isinstance(qwen, Qwen2VLImageProcessor)
    assert qwen.config.max_pixels == 12845056


def test_loader_text_only_and_unknown(tmp_path: Path) -> None:
    text = tmp_path / "text"
    text.mkdir()
    write_model(text, {"config.json": {"model_type": "llama"}})
    assert load_image_processor(text) is None
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    write_model(
        unknown,
        {
            "preprocessor_config.json": {"image_processor_type": "CLIPImageProcessor"},
            "config.json": {"model_type": "llava", "vision_config": {}},
        },
    )
    with pytest.raises(ImageProcessorConfigError, match="CLIPImageProcessor"):
        load_image_processor(unknown)
