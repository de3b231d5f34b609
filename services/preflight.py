"""The files a server is to serve, checked before anything loads: `radixserve serve` and
each service started alone (`python -m services.worker|detokenizer|tokenizer`) refuse a
model, draft model, tokenizer or LoRA adapter they cannot serve in one line naming what
they found, rather than with a loader's traceback later."""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

from engine.model.source import is_local_path, local_config, resolve_model
from services.settings import Settings


def refused_files(settings: Settings) -> str | None:
    """One line saying why the model, the draft model, the tokenizer or a LoRA adapter on
    this machine cannot be served (a missing path or adapter directory, an unreadable file,
    an unsupported architecture and the supported ones), read without loading weights; None
    when none is refused. A Hub repo id is left to the worker, which downloads it. Under
    `--log-level debug` the traceback goes to stderr first."""
    try:
        for model in (settings.model, settings.speculative_draft_model_path):
            if model is not None:
                local_config(model)
        if settings.tokenizer is not None and is_local_path(settings.tokenizer):
            resolve_model(settings.tokenizer)
        for name, path in settings.lora_entries().items():
            if not (Path(path) / "adapter_config.json").is_file():
                found = (
                    "no adapter_config.json in it" if Path(path).is_dir() else "no such directory"
                )
                raise FileNotFoundError(
                    f"LoRA adapter {name}={path}: {found} (an adapter is a PEFT directory of "
                    "adapter_config.json and adapter_model.safetensors)"
                )
    except (OSError, ValueError) as err:
        if settings.log_level == "debug":
            traceback.print_exc()
        return " ".join(str(err).split())
    return None


def exit_if_refused(settings: Settings, prog: str) -> None:
    """Exit with status 2 and `prog: error: <why>` when `refused_files` refuses a file: the
    form and status of a bad flag."""
    refusal = refused_files(settings)
    if refusal is not None:
        print(f"{prog}: error: {refusal}", file=sys.stderr)
        sys.exit(2)
