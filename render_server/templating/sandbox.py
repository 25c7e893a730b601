"""The jinja2 sandbox chat templates run in: transformers' globals and filters, plus size
checks wherever one C call could build a huge value that no deadline can interrupt."""

from __future__ import annotations

import contextlib
import functools
import json
import re
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.filters import do_format as _format_filter
from jinja2.filters import make_attrgetter
from jinja2.runtime import Context, LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from render_server.templating.errors import ChatTemplateError, ChatTemplateTooLarge

# Every integer a template holds stays within this many bits: arithmetic on bigger ones is
# one C call (Karatsuba multiplication, quadratic division) that runs for seconds holding
# the GIL, so neither the deadline nor the event loop gets a turn. At this size the slowest
# operation, a division, takes about a millisecond.
_MAX_INT_BITS = 1 << 16
# Exact types whose attribute safety depends on the attribute name alone, so the sandbox's
# answer can be remembered per (type, name).
_PLAIN_ATTR_TYPES = frozenset({dict, list, tuple, str, int, float, bool, type(None), LoopContext})
_MAX_REMEMBERED_ATTRS = 4096


def _raise_exception(message: Any) -> None:
    raise ChatTemplateError(str(message))


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter: jinja's own tojson escapes HTML characters, which templates don't want.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@jinja2.pass_context
def _sum(
    context: Context, iterable: Iterable[Any], attribute: str | int | None = None, start: Any = 0
) -> Any:
    """jinja's `sum`, one checked `+` at a time: the builtin adds a whole list in one C call
    that neither the size checks nor the deadline can stop (`[[0] * 4000] * 4000 | sum([])`
    copies 32 billion items)."""
    environment = context.environment
    assert isinstance(environment, SandboxEnvironment)
    if attribute is not None:
        iterable = map(make_attrgetter(environment, attribute), iterable)
    total = start
    for item in iterable:
        total = environment.call_binop(context, "+", total, item)
    return total


class _TemplateDict:
    """`dict(...)` for templates without exposing the dict type itself (as transformers does)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace, refusing underscore names that reach into CPython internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]  # jinja's signature trick, so namespace(self=...) works
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}` marks assistant spans for training masks; rendering keeps the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _BudgetCodeGenerator(CodeGenerator):
    """Compiles `~` to a size-checked join; jinja has a hook for binary operators, not for `~`."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Frame) -> None:
        self.write("environment.checked_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


# Widths and precisions in printf-style and str.format specs: '%0999999999d', '{:>999999999}'.
_PERCENT_SPEC = re.compile(r"%[#0 +\-]*(\d*)\.?(\d*)")
_BRACE_SPEC = re.compile(r"\{[^{}]*?:([^{}]*)\}")


def _format_widths(fmt: str) -> list[int]:
    digits = [g for groups in _PERCENT_SPEC.findall(fmt) for g in groups if g]
    digits += [d for spec in _BRACE_SPEC.findall(fmt) for d in re.findall(r"\d+", spec)]
    return [int(d) if len(d) < 12 else 10**12 for d in digits]


@contextlib.contextmanager
def _syntax_errors() -> Iterator[None]:
    try:
        yield
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template syntax error, line {exc.lineno}: {exc}") from None


# What jinja passes ahead of the filtered value to pass_context/environment/eval_context filters.
_PASSED_ARGS = (jinja2.Environment, Context, jinja2.nodes.EvalContext)


class SandboxEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox with transformers' globals, plus size checks wherever one C call
    could build a huge value, which no deadline can interrupt: `'a' * 10**9`, `7 ** 10**8`,
    doubling by `~` or `+`, any call or filter given a count or width past the budget
    (`'a'.ljust(10**9)`, `x | center(10**9)`, `'%0999999999d' % 1`), and any integer past
    `_MAX_INT_BITS`, whether arithmetic, a call or a filter made it (squaring a number over
    and over, `'f' * 10**6 | int(base=16)`)."""

    code_generator_class = _BudgetCodeGenerator
    intercepted_binops = frozenset({"+", "-", "*", "/", "//", "%", "**"})

    def __init__(self, max_value_chars: int) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols, _GenerationTag],
        )
        self.max_value_chars = max_value_chars
        self._safe_attrs: dict[tuple[type, str], bool] = {}
        self.filters.update(tojson=_tojson, sum=_sum)
        self.filters = {name: self._bounded_filter(fn) for name, fn in self.filters.items()}
        self.globals.update(
            raise_exception=_raise_exception,
            strftime_now=_strftime_now,
            dict=_TemplateDict(),
            namespace=_Namespace,
        )

    def parse_template(self, source: str) -> jinja2.nodes.Template:
        """The template's syntax tree; a syntax error is a ChatTemplateError naming its line."""
        with _syntax_errors():
            return self.parse(source)

    def compile_template(self, ast: jinja2.nodes.Template) -> jinja2.Template:
        with _syntax_errors():  # unknown filters and tests are found here
            return self.from_string(ast)

    def generate_text(self, template: jinja2.Template, context: dict[str, Any]) -> str:
        """Render `template`, stopping once its output passes the budget; any way it fails
        is a ChatTemplateError."""
        chunks: list[str] = []
        size = 0
        try:
            for chunk in template.generate(context):
                size += len(chunk)
                if size > self.max_value_chars:
                    raise ChatTemplateTooLarge(
                        f"chat template output passed {self.max_value_chars} characters"
                    )
                chunks.append(chunk)
        except ChatTemplateError:
            raise
        except jinja2.exceptions.SecurityError as exc:
            raise ChatTemplateError(f"chat template blocked by the sandbox: {exc}") from None
        except Exception as exc:  # a template can fail in any way its Python calls can
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None
        return "".join(chunks)

    def _check_size(self, size: int) -> None:
        if size > self.max_value_chars:
            raise ChatTemplateTooLarge(
                f"chat template built a value of {size} items (the limit is {self.max_value_chars})"
            )

    @staticmethod
    def _check_bits(bits: int) -> None:
        if bits > _MAX_INT_BITS:
            raise ChatTemplateTooLarge(
                f"chat template computed a number of more than {_MAX_INT_BITS} bits"
            )

    def _check_number(self, value: Any) -> None:
        if isinstance(value, int):
            self._check_bits(value.bit_length())

    def _check_ints(self, values: Iterable[Any]) -> None:
        for value in values:
            if isinstance(value, int):
                self._check_size(value)

    def _check_format(self, fmt: Any) -> None:
        if isinstance(fmt, str):
            self._check_ints(_format_widths(fmt))

    def _bounded_filter(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)  # keeps jinja's pass_context/pass_environment marks
        def bounded(*args: Any, **kwargs: Any) -> Any:
            values = [a for a in args if not isinstance(a, _PASSED_ARGS)]
            if fn is _format_filter and values:
                self._check_format(values[0])
            self._check_ints([*values[1:], *kwargs.values()])  # the filtered value may be big
            result = fn(*args, **kwargs)
            self._check_number(result)
            return result

        return bounded

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        kind = type(obj)
        if kind not in _PLAIN_ATTR_TYPES:
            return super().is_safe_attribute(obj, attr, value)
        key = (kind, attr)
        safe = self._safe_attrs.get(key)
        if safe is None:
            safe = super().is_safe_attribute(obj, attr, value)
            if len(self._safe_attrs) < _MAX_REMEMBERED_ATTRS:  # names come from templates
                self._safe_attrs[key] = safe
        return safe

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        """A blocked attribute fails the render at once. jinja returns an Undefined that
        fails only when used further, so `''.__class__`, `x | attr('__class__')` or a
        format string's `{0.__class__}` rendered as nothing and the request went on with a
        prompt the template never meant."""
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe."
        )

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        __self._check_ints([*args, *kwargs.values()])
        # The sandbox's str.format wrapper keeps the format string as __wrapped__.__self__.
        __self._check_format(getattr(getattr(__obj, "__wrapped__", None), "__self__", None))
        result = super().call(__context, __obj, *args, **kwargs)
        __self._check_number(result)  # (1).from_bytes(...) builds one from any bytes
        return result

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "+" and type(left) is str and type(right) is str:  # most of any template
            if len(left) + len(right) > self.max_value_chars:
                self._check_size(len(left) + len(right))
            return left + right
        sized = (str, list, tuple)
        if isinstance(left, int) and isinstance(right, int):
            self._check_number(left)
            self._check_number(right)
            # The fewest bits the result can have, checked before the C call that would take
            # seconds to make it; what it makes (at most twice the limit) is checked after.
            if operator == "**" and right > 0:
                self._check_bits((abs(left).bit_length() - 1) * right + 1)
            elif operator == "*":
                self._check_bits(left.bit_length() + right.bit_length() - 1)
        elif operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, sized) and isinstance(count, int):
                    self._check_size(len(seq) * count)
        elif operator == "+" and isinstance(left, sized) and isinstance(right, sized):
            self._check_size(len(left) + len(right))
        elif operator == "%":
            self._check_format(left)
        result = super().call_binop(context, operator, left, right)
        self._check_number(result)  # `+` and `-` grow one bit at a time
        return result

    def checked_concat(self, values: tuple[Any, ...]) -> str:
        parts = [str(value) for value in values]
        self._check_size(sum(map(len, parts)))
        return "".join(parts)
