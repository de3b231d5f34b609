"""The one error of the LoRA machinery, shaped for an HTTP answer."""

from __future__ import annotations


class LoRAError(ValueError):
    """A LoRA request the engine refuses: `status` is the HTTP status a server answers
    with (400 bad adapter, 404 unknown name, 409 in use), `param` the field to name."""

    def __init__(self, message: str, status: int = 400, param: str | None = "lora_path"):
        super().__init__(message)
        self.status = status
        self.param = param
