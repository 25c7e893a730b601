"""Per-family tool-call and reasoning parsers when the operator names none."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from render_server.http.app import build_state
from render_server.parsing.family_defaults import (
    family_defaults,
    model_architecture,
    model_family,
)
from render_server.parsing.tool_choice import tool_setup
from render_server.settings import RenderSettings
from shared.model_source import ModelSource

LLAMA3_TEMPLATE = "{{ '<|start_header_id|>' + messages[0]['role'] + '<|end_header_id|>' }}"
MISTRAL_TEMPLATE = "{{ '[INST] ' + messages[0]['content'] + ' [/INST]' }}"
CHATML = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + m['content'] }}{% endfor %}"


@pytest.mark.parametrize(
    ("architecture", "template", "family"),
    [
        ("Qwen3ForCausalLM", None, "qwen3"),
        ("qwen3", None, "qwen3"),
        ("Qwen3MoeForCausalLM", None, "qwen3"),
        ("LlamaForCausalLM", LLAMA3_TEMPLATE, "llama3"),
        ("llama", LLAMA3_TEMPLATE, "llama3"),
        ("llama", CHATML, None),  # SmolLM2: llama arch, ChatML template
        ("llama", MISTRAL_TEMPLATE, "mistral"),  # Mistral GGUFs say "llama"
        ("MistralForCausalLM", None, "mistral"),
        ("Gemma3ForCausalLM", None, "gemma"),
        ("phi3", None, "phi"),
        ("Qwen2ForCausalLM", CHATML, None),
        (None, None, None),
    ],
)
def test_model_family(architecture: str | None, template: str | None, family: str | None) -> None:
    assert model_family(architecture, template) == family


def test_architecture_from_config_json_and_gguf(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    assert model_architecture(ModelSource("m", "hf", hf)) == "Qwen3ForCausalLM"
    (hf / "config.json").write_text(json.dumps({"model_type": "gemma3"}))
    assert model_architecture(ModelSource("m", "hf", hf)) == "gemma3"
    (hf / "config.json").unlink()
    assert model_architecture(ModelSource("m", "hf", hf)) is None

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    defaults = family_defaults(ModelSource("m", "gguf", path), None)
    assert (defaults.family, defaults.tool_call_parser, defaults.reasoning_parser) == (
        "qwen3",
        "hermes",
        "qwen3",
    )


def test_family_parser_fills_in_only_what_the_flag_and_template_leave() -> None:
    def setup(flag: str | None, template: str | None, family: str | None) -> tuple[object, ...]:
        s = tool_setup(
            tool_call_parser=flag,
            enable_auto_tool_choice=False,
            chat_template=template,
            builtin_template=None,
            family_tool_parser=family,
        )
        return s.parser_name, s.allows_auto

    assert setup(None, CHATML, "llama3_json") == ("llama3_json", True)
    assert setup(None, "{{ '<tool_call>' }}", "llama3_json") == ("hermes", True)  # template
    assert setup("pythonic", CHATML, "llama3_json") == ("pythonic", False)  # the flag
    assert setup(None, CHATML, None) == (None, False)


def _model_dir(tmp_path: Path, architecture: str, template: str) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    return tmp_path


def test_server_takes_the_family_defaults_unless_flags_say_otherwise(tmp_path: Path) -> None:
    model = str(_model_dir(tmp_path, "Qwen3ForCausalLM", CHATML))
    state = build_state(RenderSettings(model=model, render_only=True))
    assert state.settings.reasoning_parser == "qwen3"
    assert state.family_tool_parser == "hermes"
    assert state.tool_setup().parser_name == "hermes"
    explicit = RenderSettings(
        model=model, render_only=True, reasoning_parser="deepseek_r1", tool_call_parser="pythonic"
    )
    state = build_state(explicit)
    assert state.settings.reasoning_parser == "deepseek_r1"
    assert state.tool_setup().parser_name == "pythonic"
