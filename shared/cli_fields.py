"""Command lines generated from config classes: one field, one flag.

A config class (a dataclass, or a pydantic model such as pydantic-settings' BaseSettings)
is the single source of each option: the field's name gives the flag, its type the
argparse type (bool: a switch, list: repeatable, Literal: choices), its default the
default shown in the help, and its docstring the help text. What the field alone cannot
say goes in a `Flag` in its `Annotated[...]` metadata: another name, a metavar, where a help
section starts, a hidden flag, or `NOT_A_FLAG` for a field that must stay off the CLI.

Parsers built here leave flags that were not given out of the namespace (argparse's
SUPPRESS): the config class fills them, from its defaults, or for pydantic-settings from
the environment first, so a flag overrides `DUET_*`, which overrides the default.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union


@dataclass(frozen=True)
class Flag:
    """How one config field appears on the command line: `Annotated[T, Flag(...)]`."""

    name: str | None = None
    """The option string; by default `--` and the field name in dashes, a `_s` (seconds)
    suffix dropped, with `--no-` in front for a bool that defaults to True."""
    metavar: str | None = None
    """The value's placeholder in the help; SECONDS for `_s` fields by default."""
    section: str | None = None
    """Title of a help section that starts at this field and runs to the next one."""
    split_commas: bool = False
    """Each value of a repeatable flag may also be a comma-separated list."""
    hidden: bool = False
    """Accepted but left out of `--help` (testing hooks)."""
    is_flag: bool = True
    """False: the field is configuration but not a command-line option."""


NOT_A_FLAG = Flag(is_flag=False)
"""Marks a field that stays off the command line (set by the program or the environment)."""


@dataclass(frozen=True)
class ConfigField:
    """One field of a config class, as the command line sees it."""

    name: str
    """The field's name; also the flag's argparse dest."""
    annotation: Any
    """The field's type, `Annotated` metadata removed."""
    default: Any
    """The default (a default factory already called); `dataclasses.MISSING` if required."""
    doc: str
    """The docstring under the field: the flag's help."""
    flag: Flag
    """The field's `Flag`, or a default one when it has none."""

    @property
    def option(self) -> str:
        """The option string, e.g. `--max-num-seqs`."""
        if self.flag.name is not None:
            return self.flag.name
        stem = self.name.removesuffix("_s").replace("_", "-")
        return f"--no-{stem}" if self.annotation is bool and self.default is True else f"--{stem}"


def add_fields(parser: argparse.ArgumentParser, config_cls: type) -> None:
    """Add a flag to `parser` for every field of `config_cls` that is one, in field order."""
    add_argument: Callable[..., argparse.Action] = parser.add_argument
    for field in config_fields(config_cls):
        if field.flag.section is not None:
            add_argument = parser.add_argument_group(field.flag.section).add_argument
        if field.flag.is_flag:
            add_argument(field.option, dest=field.name, **_argparse_options(field))


def given_fields(args: argparse.Namespace, config_cls: type) -> dict[str, Any]:
    """The flags of `config_cls` that were given, as keyword arguments for it."""
    names = {field.name for field in config_fields(config_cls)}
    return {name: value for name, value in vars(args).items() if name in names}


@functools.cache
def config_fields(config_cls: type) -> tuple[ConfigField, ...]:
    """The fields of a dataclass or pydantic model, each with its type, default and doc."""
    if dataclasses.is_dataclass(config_cls):
        return _dataclass_fields(config_cls)
    model_fields = getattr(config_cls, "model_fields", None)
    if model_fields is None:
        raise TypeError(f"{config_cls.__name__} is neither a dataclass nor a pydantic model")
    return tuple(
        ConfigField(
            name=name,
            annotation=info.annotation,
            default=_pydantic_default(info),
            doc=info.description or "",
            flag=_flag_in(info.metadata),
        )
        for name, info in model_fields.items()
    )


def attribute_docstrings(cls: type) -> dict[str, str]:
    """The docstrings written under a class's annotated attributes, read from its source."""
    (class_def,) = ast.parse(textwrap.dedent(inspect.getsource(cls))).body
    assert isinstance(class_def, ast.ClassDef)
    docs: dict[str, str] = {}
    body = class_def.body
    for node, after in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _dataclass_fields(config_cls: type) -> tuple[ConfigField, ...]:
    hints = typing.get_type_hints(config_cls, include_extras=True)
    docs = attribute_docstrings(config_cls)
    result = []
    for field in dataclasses.fields(config_cls):
        hint = hints[field.name]
        metadata: tuple[Any, ...] = ()
        if typing.get_origin(hint) is typing.Annotated:
            hint, *extra = typing.get_args(hint)
            metadata = tuple(extra)
        default = field.default
        if field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        doc = docs.get(field.name, "")
        result.append(ConfigField(field.name, hint, default, doc, _flag_in(metadata)))
    return tuple(result)


def _pydantic_default(info: Any) -> Any:
    if info.is_required():
        return dataclasses.MISSING
    return info.get_default(call_default_factory=True)


def _flag_in(metadata: typing.Iterable[Any]) -> Flag:
    return next((item for item in metadata if isinstance(item, Flag)), Flag())


def _argparse_options(field: ConfigField) -> dict[str, Any]:
    """add_argument's keywords for one field; every default is SUPPRESS (see the module)."""
    if not field.doc:
        raise TypeError(f"config field {field.name} has no docstring to be its flag's help")
    options: dict[str, Any] = {"default": argparse.SUPPRESS, "help": _help(field)}
    kind = _without_none(field.annotation)
    if kind is bool:
        options["action"] = "store_false" if field.default is True else "store_true"
        return options
    metavar = field.flag.metavar or ("SECONDS" if field.name.endswith("_s") else None)
    if metavar is not None:
        options["metavar"] = metavar
    if typing.get_origin(kind) is list:
        # Repeatable; with split_commas each value may also be "a,b" (extended item by item).
        split = field.flag.split_commas
        options["action"] = "extend" if split else "append"
        options["type"] = _comma_split if split else _value_type(typing.get_args(kind)[0])
    elif typing.get_origin(kind) is Literal:
        options["choices"] = list(typing.get_args(kind))
    else:
        options["type"] = _value_type(kind)
    return options


def _help(field: ConfigField) -> str:
    """The field's docstring on one line, with its default (argparse %-formats help)."""
    if field.flag.hidden:
        return argparse.SUPPRESS
    text = " ".join(field.doc.split()).replace("%", "%%").removesuffix(".")
    default = field.default
    if isinstance(default, list):
        default = ",".join(map(str, default))
    if default is True:  # a `--no-` switch: the doc says what it turns off
        return f"{text} (on unless this flag is given)."
    if default is None or default is False or default in ("", dataclasses.MISSING):
        return f"{text}."
    return f"{text} (default: {default})."


def _without_none(annotation: Any) -> Any:
    """`T | None` -> T; anything else unchanged."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _value_type(kind: Any) -> Callable[[str], Any] | None:
    if kind in (int, float, Path):
        return typing.cast(Callable[[str], Any], kind)
    if kind is str:
        return None
    raise TypeError(f"no command-line type for {kind!r}")


def _comma_split(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]
