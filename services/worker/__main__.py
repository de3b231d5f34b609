"""`python -m services.worker [flags]`: flags and RADIXSERVE_* variables as in `Settings`.

With `--node-rank K` (K > 0) it runs node K's tensor-parallel ranks only: they follow rank
0, on node 0, and have no sockets to the tokenizer or the detokenizer."""

from engine.api import serve_node
from services.process import configure_logging
from services.settings import Settings
from services.worker.worker import Worker


def main() -> None:
    settings = Settings.from_cli(prog="python -m services.worker", wire=True)
    configure_logging(settings.log_level, Worker.role)
    if settings.node_rank > 0:
        serve_node(settings.to_engine_args())
    else:
        Worker(settings).serve_forever()


if __name__ == "__main__":
    main()
