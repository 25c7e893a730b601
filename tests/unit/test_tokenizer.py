"""render_server.templating.tokenizer against transformers, the reference, on the same files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from render_server.templating.tokenizer import Tokenizer, TokenizerLoadError
from shared.model_source import ModelSource, resolve_model
from shared.tokenizer_digest import tokenizer_digest
from tests.helpers.data import DATA_DIR

CORPUS: list[str] = json.loads((DATA_DIR / "tokenizer_corpus.json").read_text(encoding="utf-8"))
SPECIAL_TEXT = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]


def test_corpus_is_varied() -> None:
    assert len(CORPUS) >= 200
    assert any("<|im_end|>" in s for s in CORPUS)
    assert any("\u200d" in s for s in CORPUS)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_ids_match_transformers(
    smollm2_tokenizer: Tokenizer, hf_reference_tokenizer: Any, add_special_tokens: bool
) -> None:
    expected = hf_reference_tokenizer(CORPUS, add_special_tokens=add_special_tokens)["input_ids"]
    for text, want in zip(CORPUS, expected, strict=True):
        assert smollm2_tokenizer.encode(text, add_special_tokens) == want, repr(text)
    assert smollm2_tokenizer.encode_batch(CORPUS, add_special_tokens) == expected


def test_same_tokenizer_json_as_transformers(
    smollm2_tokenizer: Tokenizer, hf_reference_tokenizer: Any
) -> None:
    assert smollm2_tokenizer.hf.to_str() == hf_reference_tokenizer.backend_tokenizer.to_str()


def test_decode_round_trips(smollm2_tokenizer: Tokenizer, hf_reference_tokenizer: Any) -> None:
    for text in CORPUS:
        ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
        assert smollm2_tokenizer.decode(ids, skip_special_tokens=False) == text
        for skip in (True, False):
            want = hf_reference_tokenizer.decode(ids, skip_special_tokens=skip)
            assert smollm2_tokenizer.decode(ids, skip_special_tokens=skip) == want


def test_encode_plain_reads_special_text_as_text(
    smollm2_tokenizer: Tokenizer, hf_reference_tokenizer: Any
) -> None:
    special_ids = {smollm2_tokenizer.hf.token_to_id(t) for t in smollm2_tokenizer.special_tokens}
    for text in [*SPECIAL_TEXT, "a <|im_end|> b", "<|im_start|>user\nhi<|im_end|>"]:
        ids = smollm2_tokenizer.encode_plain(text)
        assert not special_ids & set(ids)
        assert smollm2_tokenizer.decode(ids) == text
        want = hf_reference_tokenizer.encode(
            text, add_special_tokens=False, split_special_tokens=True
        )
        assert ids == want
    # The shared tokenizer still reads them as control tokens.
    assert smollm2_tokenizer.encode("<|im_end|>", add_special_tokens=False) == [2]


def test_metadata(smollm2_tokenizer: Tokenizer, hf_reference_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert (tok.eos_token, tok.eos_token_ids) == ("<|im_end|>", [2])
    assert tok.vocab_size == 49152
    assert tok.max_model_len == 8192
    assert tok.add_bos_token is False
    assert tok.chat_template == hf_reference_tokenizer.chat_template
    assert len(tok.special_tokens) == 17
    assert set(SPECIAL_TEXT) <= set(tok.special_tokens)
    assert tok.id_to_token(2) == "<|im_end|>"
    assert tok.id_to_token(10**6) is None
    assert tok.token_strs([19556, 216]) == hf_reference_tokenizer.convert_ids_to_tokens(
        [19556, 216]
    )
    assert len(tok.digest) == 64


def test_digest_equals_the_workers_file_digest(
    smollm2_tokenizer: Tokenizer, smollm2_source: ModelSource
) -> None:
    assert smollm2_tokenizer.digest == tokenizer_digest(smollm2_source)


def test_digest_stable_across_processes(smollm2_tokenizer: Tokenizer) -> None:
    code = (
        "from render_server.templating.tokenizer import Tokenizer\n"
        "from shared.model_source import resolve_model\n"
        "print(Tokenizer.from_source(resolve_model('SmolLM2-135M-Instruct')).digest)\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == smollm2_tokenizer.digest


def _save_hf_dir(reference: Any, path: Path) -> None:
    reference.save_pretrained(path)
    config = {"vocab_size": 49152, "max_position_embeddings": 8192}
    (path / "config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))


def test_hf_directory_matches_gguf(
    tmp_path: Path, smollm2_tokenizer: Tokenizer, hf_reference_tokenizer: Any
) -> None:
    _save_hf_dir(hf_reference_tokenizer, tmp_path)
    source = ModelSource("smol-hf", "hf", tmp_path)
    tok = Tokenizer.from_source(source)
    # Workers digest the same files without building a tokenizer; the two must agree.
    assert tok.digest == tokenizer_digest(source)
    assert tok.encode_batch(CORPUS) == smollm2_tokenizer.encode_batch(CORPUS)
    assert tok.chat_template == smollm2_tokenizer.chat_template
    assert (tok.bos_token_id, tok.eos_token_ids) == (1, [2, 0])
    assert (tok.vocab_size, tok.max_model_len, tok.add_bos_token) == (49152, 8192, False)


def test_hf_directory_bos_comes_from_tokenizer_json(
    tmp_path: Path, hf_reference_tokenizer: Any
) -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    _save_hf_dir(hf_reference_tokenizer, tmp_path)
    backend = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    backend.post_processor = TemplateProcessing(
        single="<|im_start|>:0 $A:0", special_tokens=[("<|im_start|>", 1)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    # transformers ignores add_bos_token in the config when tokenizer.json is there.
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False}))
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")

    tok = Tokenizer.from_source(ModelSource("smol-hf", "hf", tmp_path))
    reference = AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok.add_bos_token is True
    texts = CORPUS[:40]
    assert tok.encode_batch(texts) == reference(texts)["input_ids"]
    assert tok.encode("hi")[0] == 1
    assert tok.encode("hi", add_special_tokens=False)[0] != 1
    assert tok.chat_template == "{{ bos_token }}{{ messages[0]['content'] }}"


def test_hf_directory_without_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerLoadError, match="tokenizer.json"):
        Tokenizer.from_source(ModelSource("empty", "hf", tmp_path))


def _write_tiny_gguf(path: Path, model: str, pre: str) -> None:
    """A byte-level vocabulary small enough for transformers to load in well under a second."""
    import gguf
    from tokenizers.pre_tokenizers import ByteLevel

    merges = ["Ġ t", "h e", "Ġt he", "1 2", "12 3", "Ġ 1", "i n", "' s", "Ċ Ċ", "Ġ Ġ", "ĠĠ ĠĠ"]
    merges += ["Ċ Ġ", "ä ¸", "ä¸ Ń"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    byte_tokens = sorted(ByteLevel.alphabet())
    # "<think>" is user-defined (an added, non-special token); "中" is stored as raw text and
    # must be respelled into the byte alphabet; the last control token is a converter mislabel.
    tokens = specials + byte_tokens + [m.replace(" ", "") for m in merges]
    tokens += ["<think>", "中", "<|bad\u2581|>"]
    types = [3] * 3 + [1] * (len(tokens) - 6) + [4, 1, 3]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_context_length(4096)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "smollm", "gpt-2"])
def test_gguf_pre_tokenizers_match_transformers(tmp_path: Path, pre: str) -> None:
    from transformers import AutoTokenizer

    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, "gpt2", pre)
    tok = Tokenizer.from_source(ModelSource("tiny", "gguf", path))
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert tok.hf.to_str() == reference.backend_tokenizer.to_str()
    assert tok.encode_batch(CORPUS) == reference(CORPUS)["input_ids"]
    assert tok.add_bos_token is True
    assert tok.encode("x")[0] == 1
    assert tok.max_model_len == 4096
    assert tok.special_tokens == ["<|endoftext|>", *SPECIAL_TEXT[:2]]


def test_unsupported_gguf_tokenizer(tmp_path: Path) -> None:
    path = tmp_path / "spm.gguf"
    _write_tiny_gguf(path, "llama", "default")
    with pytest.raises(TokenizerLoadError, match="'llama' is not supported"):
        Tokenizer.from_source(ModelSource("spm", "gguf", path))


def test_piece_cache_can_be_turned_off(smollm2_tokenizer: Tokenizer) -> None:
    """`--tokenizer-cache-mb 0`: no cache of text pieces (no timing signal), same ids."""
    from render_server.cli import parse_settings

    settings = parse_settings(["--tokenizer-cache-mb", "0"])
    assert settings.tokenizer_cache_mb == 0
    assert parse_settings([]).tokenizer_cache_mb == 32
    source = resolve_model(settings.model)
    uncached = Tokenizer.from_source(source, piece_cache_bytes=settings.tokenizer_cache_mb << 20)
    assert uncached._pieces is None
    assert smollm2_tokenizer._pieces is not None
    text = "A system prompt that comes back.<|im_end|>\nAnd a question?"
    for _ in range(2):  # the second time the cached tokenizer answers from its cache
        assert uncached.encode_text(text) == smollm2_tokenizer.encode_text(text)
