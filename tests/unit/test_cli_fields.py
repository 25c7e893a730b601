"""shared/cli_fields.py: a config class's fields become flags, and only the given ones
reach the config (so pydantic-settings can fill the rest from the environment)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import pytest

from shared.cli_fields import NOT_A_FLAG, Flag, add_fields, config_fields, given_fields


@dataclass(frozen=True, kw_only=True)
class _Example:
    """A config with one field of each kind the generator handles."""

    name: Annotated[str, Flag(section="things")] = "x"
    """A plain string."""
    size: int | None = None
    """An optional int."""
    wait_s: float = 1.5
    """Seconds: the flag drops the suffix, the metavar says SECONDS."""
    path: Path | None = None
    """A path."""
    mode: Literal["a", "b"] = "a"
    """A choice."""
    verbose: bool = False
    """A switch."""
    cache: bool = True
    """On by default: the flag is --no-cache."""
    items: Annotated[list[str], Flag(name="--item", split_commas=True)] = field(
        default_factory=list
    )
    """Repeatable and comma-separated."""
    hook: Annotated[str | None, Flag(hidden=True)] = None
    """Hidden."""
    internal: Annotated[int, NOT_A_FLAG] = 3
    """Not a flag."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="example")
    add_fields(parser, _Example)
    return parser


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.option_strings[-1]: a for a in parser._actions if a.option_strings}


def test_fields_become_flags() -> None:
    options = _options(_parser())
    assert sorted(options) == [
        "--help", "--hook", "--item", "--mode", "--name", "--no-cache", "--path", "--size",
        "--verbose", "--wait",
    ]  # fmt: skip
    assert options["--wait"].metavar == "SECONDS"
    assert options["--wait"].type is float
    assert options["--size"].type is int
    assert options["--path"].type is Path
    assert options["--mode"].choices == ["a", "b"]
    assert options["--hook"].help == argparse.SUPPRESS
    assert options["--no-cache"].dest == "cache"
    assert options["--wait"].help == (
        "Seconds: the flag drops the suffix, the metavar says SECONDS (default: 1.5)."
    )


def test_only_given_flags_reach_the_config() -> None:
    parser = _parser()
    assert given_fields(parser.parse_args([]), _Example) == {}
    args = parser.parse_args(
        ["--wait", "2", "--no-cache", "--verbose", "--item", "a, b", "--item", "c", "--mode", "b"]
    )
    config = _Example(**given_fields(args, _Example))
    assert config == _Example(
        wait_s=2.0, cache=False, verbose=True, items=["a", "b", "c"], mode="b"
    )


def test_sections_group_the_help() -> None:
    text = _parser().format_help()
    assert "things:\n  --name NAME" in text


def test_a_flag_without_a_docstring_is_an_error() -> None:
    @dataclass(frozen=True)
    class Undocumented:
        """No field docstring."""

        size: int = 1

    with pytest.raises(TypeError, match="size has no docstring"):
        add_fields(argparse.ArgumentParser(), Undocumented)


def test_render_settings_fields_are_all_documented_flags_or_marked() -> None:
    from render_server.cli import build_parser
    from render_server.settings import RenderSettings

    fields = config_fields(RenderSettings)
    assert all(f.doc for f in fields)
    internal = {f.name for f in fields if not f.flag.is_flag}
    assert internal == {
        "render_max_output_chars",
        "metrics_multiprocess_dir",
    }
    dests = {a.dest for a in build_parser()._actions} - {"help"}
    assert dests == {f.name for f in fields} - internal


def test_flags_override_environment_which_overrides_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from render_server.cli import parse_settings

    assert parse_settings([]).port == 8000
    monkeypatch.setenv("DUET_PORT", "9000")
    monkeypatch.setenv("DUET_API_KEY", "k1,k2")
    assert parse_settings([]).port == 9000
    assert parse_settings([]).api_keys == ["k1", "k2"]
    settings = parse_settings(["--port", "9100", "--api-key", "k3"])
    assert settings.port == 9100
    assert settings.api_keys == ["k3"]
