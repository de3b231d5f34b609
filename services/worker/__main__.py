"""`python -m services.worker [flags]`: flags and RADIXSERVE_* variables as in `Settings`.

With `--node-rank K` (K > 0) it runs node K's tensor-parallel ranks only: they follow rank
0, on node 0, and have no sockets to the tokenizer or the detokenizer."""

# isort: off
from engine.kernels.cpu.isa import apply_forced_isa

apply_forced_isa()  # before torch first dispatches: a forced kernel path caps ATen and oneDNN
from engine.build import serve_node  # noqa: E402
from services.preflight import exit_if_refused  # noqa: E402
from services.process import configure_logging  # noqa: E402
from services.settings import Settings  # noqa: E402
from services.worker.worker import Worker  # noqa: E402

# isort: on


def main() -> None:
    prog = "python -m services.worker"
    settings = Settings.from_cli(prog=prog, wire=True)
    configure_logging(settings.log_level, Worker.role)
    exit_if_refused(settings, prog)
    if settings.node_rank > 0:
        serve_node(settings.to_engine_args())
    else:
        Worker(settings).serve_forever()


if __name__ == "__main__":
    main()
