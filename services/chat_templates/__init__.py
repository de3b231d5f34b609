"""Chat templates shipped for models whose files carry none (a base model's GGUF), chosen
with `--chat-template NAME`; `NAME.jinja` in this folder."""

from __future__ import annotations

from pathlib import Path

NAMED_TEMPLATES_DIR = Path(__file__).parent


def named_chat_templates() -> list[str]:
    return sorted(path.stem for path in NAMED_TEMPLATES_DIR.glob("*.jinja"))


def read_chat_template(choice: str) -> str:
    """`--chat-template`: a named template or a Jinja file's text; anything else is refused
    in one line naming both forms."""
    named = NAMED_TEMPLATES_DIR / f"{choice}.jinja"
    path = named if named.is_file() else Path(choice).expanduser()
    if not path.is_file():
        raise ValueError(
            f"--chat-template {choice!r} is neither a named template "
            f"({', '.join(named_chat_templates())}) nor a file"
        )
    return path.read_text()
