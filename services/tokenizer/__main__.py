"""`python -m services.tokenizer [flags]`: the HTTP API on --host/--port; flags and
RADIXSERVE_* variables as in `Settings`."""

import uvicorn

from engine.model.loader import load_tokenizer
from services.process import configure_logging
from services.settings import Settings
from services.tokenizer.middleware import ApiKeyFileError
from services.tokenizer.server import EdgeProtocol, create_app


def main() -> None:
    settings = Settings.from_cli(prog="python -m services.tokenizer")
    configure_logging(settings.log_level, "tokenizer")
    tokenizer = (
        None
        if settings.skip_tokenizer_init
        else load_tokenizer(settings.tokenizer or settings.model)
    )
    try:
        app = create_app(settings, tokenizer)
    except ApiKeyFileError as e:
        raise SystemExit(f"python -m services.tokenizer: error: {e}") from None
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
