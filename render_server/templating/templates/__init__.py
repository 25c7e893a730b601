"""Chat templates shipped with duet, selectable by name with `--chat-template NAME`.

- `chatml_tools`: hermes-style ChatML with tool calling (pairs with `--tool-call-parser
  hermes`); renders plain chats exactly like SmolLM2's own template.
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).parent
BUILTIN_TEMPLATES = {path.stem: path for path in _HERE.glob("*.jinja")}


def read_chat_template(value: Path | str) -> str:
    """The template text of `--chat-template`: a file path, or a built-in name."""
    path = Path(value)
    if not path.exists() and str(value) in BUILTIN_TEMPLATES:
        path = BUILTIN_TEMPLATES[str(value)]
    return path.read_text(encoding="utf-8")
