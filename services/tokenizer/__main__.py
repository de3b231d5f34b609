"""`python -m services.tokenizer [flags]`: the HTTP API on --host/--port; flags and
RADIXSERVE_* variables as in `Settings`."""

import logging

import uvicorn

from engine.model.tokenizer_cache import load_tokenizer
from services.chat_templates import read_chat_template
from services.preflight import exit_if_refused
from services.process import configure_logging
from services.settings import Settings
from services.tokenizer.middleware import ApiKeyFileError
from services.tokenizer.server import EdgeProtocol, create_app

PROBE_PATHS = frozenset({"/health", "/healthz", "/metrics"})
"""Asked every few seconds by kubelets, scrapers and `radixserve serve` while it waits: one
access-log line each would bury the requests (`--log-probe-requests` keeps them)."""


class ProbeFilter(logging.Filter):
    """Drops uvicorn's access-log records of `PROBE_PATHS` (their args are client, method,
    path with query, HTTP version, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return args[2].split("?", 1)[0] not in PROBE_PATHS
        return True


def main() -> None:
    prog = "python -m services.tokenizer"
    settings = Settings.from_cli(prog=prog, wire=True)
    configure_logging(settings.log_level, "tokenizer")
    exit_if_refused(settings, prog)
    if not settings.log_probe_requests:
        logging.getLogger("uvicorn.access").addFilter(ProbeFilter())
    tokenizer = (
        None
        if settings.skip_tokenizer_init
        else load_tokenizer(settings.tokenizer or settings.model)
    )
    if tokenizer is not None and settings.chat_template is not None:
        tokenizer.chat_template = read_chat_template(settings.chat_template)
    try:
        app = create_app(settings, tokenizer)
    except ApiKeyFileError as e:
        raise SystemExit(f"{prog}: error: {e}") from None
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        http=EdgeProtocol.configured(settings),
        log_config=None,
        log_level=settings.log_level,
        # uvicorn annotates this as int but passes it to asyncio.wait_for, which takes any
        # number of seconds: a fractional timeout is honoured as given.
        timeout_graceful_shutdown=settings.graceful_shutdown_timeout,  # type: ignore[arg-type]
    )


if __name__ == "__main__":
    main()
