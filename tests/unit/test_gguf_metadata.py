"""shared/gguf_metadata.py reads what gguf.GGUFReader reads, without mapping tensors."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from shared.gguf_metadata import GGUFError, read_gguf_metadata
from shared.model_source import ModelSource


def _write(path: Path) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int16("t.i16", -3)
    writer.add_uint64("t.u64", 2**40)
    writer.add_float32("t.f32", 0.1)
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo")
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.floats", [0.5, 1.5])
    writer.add_array("t.strs", ["a", "Ġb", ""])
    writer.add_context_length(4096)
    writer.add_tensor("token_embd.weight", np.ones((10, 8), np.float32))
    writer.add_tensor("rope_freqs.weight", np.arange(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _reference(path: Path) -> tuple[dict[str, object], gguf.GGUFReader]:
    reader = gguf.GGUFReader(path)
    fields = {n: f.contents() for n, f in reader.fields.items() if not n.startswith("GGUF.")}
    return fields, reader


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    _write(path)
    return path


def _assert_same_as_gguf_reader(path: Path) -> None:
    meta = read_gguf_metadata(path)
    fields, reader = _reference(path)
    assert list(meta.fields) == list(fields)
    for key, value in fields.items():
        assert (meta.fields[key], type(meta.fields[key])) == (value, type(value)), key
    assert list(meta.tensors) == [t.name for t in reader.tensors]
    for tensor in reader.tensors:
        info = meta.tensors[tensor.name]
        assert info.shape == tuple(int(d) for d in tensor.shape)
        assert info.ggml_type == int(tensor.tensor_type)
        assert info.offset == tensor.data_offset


def test_every_value_type_and_the_tensor_table_match_gguf_reader(tiny: Path) -> None:
    _assert_same_as_gguf_reader(tiny)


@pytest.mark.slow  # gguf.GGUFReader takes seconds over SmolLM2's vocabulary
def test_smollm2_header_matches_gguf_reader(smollm2_source: ModelSource) -> None:
    _assert_same_as_gguf_reader(Path(smollm2_source.path))


def test_typed_accessors(tiny: Path) -> None:
    meta = read_gguf_metadata(tiny)
    assert meta.integer("t.u64") == 2**40
    assert meta.integer("absent") is None
    assert meta.integer("absent", 7) == 7
    assert meta.number("t.ints.absent", 1.0) == 1.0
    assert meta.number("llama.context_length") == 4096.0
    assert meta.string("t.str") == "héllo"
    assert meta.strings("t.strs") == ["a", "Ġb", ""]
    assert meta.integers("t.ints") == [1, 2, 3]
    assert meta.strings("absent") == []
    with pytest.raises(GGUFError, match="t.str"):
        meta.integer("t.str")
    with pytest.raises(GGUFError, match="t.ints"):
        meta.strings("t.ints")


def test_keys_reads_only_those_and_no_tensor_table(tiny: Path) -> None:
    meta = read_gguf_metadata(tiny, {"t.strs", "t.u8", "not.there"})
    assert meta.fields == {"t.u8": 200, "t.strs": ["a", "Ġb", ""]}
    assert meta.tensors == {}


def test_not_gguf_and_truncated_files_are_gguf_errors(tiny: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(40))
    with pytest.raises(GGUFError, match="not a GGUF file"):
        read_gguf_metadata(bad)
    bad.write_bytes(tiny.read_bytes()[:60])
    with pytest.raises(GGUFError, match="malformed"):
        read_gguf_metadata(bad)
    bad.write_bytes(b"")
    with pytest.raises(GGUFError):
        read_gguf_metadata(bad)
