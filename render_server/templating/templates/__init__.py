"""Chat templates shipped with duet, selectable by name with `--chat-template NAME`.

- `chatml_tools`: hermes-style ChatML with tool calling (the `hermes` tool parser reads
  its calls). It is also the default for tool requests to a ChatML model whose own
  template shows no tools (SmolLM2, the built-in model): `tools_template_for`.
"""

from __future__ import annotations

from pathlib import Path

import jinja2.meta

from render_server.templating.errors import ChatTemplateError
from render_server.templating.sandbox import SandboxEnvironment

_HERE = Path(__file__).parent
BUILTIN_TEMPLATES = {path.stem: path for path in _HERE.glob("*.jinja")}
_CHATML_TURN = "<|im_start|>"


def read_chat_template(value: Path | str) -> str:
    """The template text of `--chat-template`: a file path, or a built-in name."""
    path = Path(value)
    if not path.exists() and str(value) in BUILTIN_TEMPLATES:
        path = BUILTIN_TEMPLATES[str(value)]
    return path.read_text(encoding="utf-8")


def shows_tools(template: str) -> bool:
    """Whether a chat template reads the `tools` it is given (parsed as the renderer parses
    it, never run). One that does not parse counts as showing them: it is left alone."""
    try:
        ast = SandboxEnvironment(max_value_chars=1).parse_template(template)
    except ChatTemplateError:
        return True
    return "tools" in jinja2.meta.find_undeclared_variables(ast)


_PHI4_ROLE_SEPARATOR = "<|im_sep|>"


def tools_template_for(model_template: str | None) -> str | None:
    """The built-in template that shows tools to a model whose own template cannot: a
    ChatML model's gets `chatml_tools`, in the turn format it was trained on. None when
    the model's template shows tools itself, or is of a family with no built-in one."""
    if model_template is None or _CHATML_TURN not in model_template:
        return None
    if _PHI4_ROLE_SEPARATOR in model_template:
        # Phi-4 writes `<|im_start|>role<|im_sep|>`: not the ChatML turns chatml_tools
        # writes, so it would show the model a format it was never trained on.
        return None
    if shows_tools(model_template):
        return None
    return read_chat_template("chatml_tools")
