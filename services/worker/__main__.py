"""`python -m services.worker [flags]`: flags and RADIXSERVE_* variables as in `Settings`."""

from services.process import run_service
from services.worker.worker import Worker

if __name__ == "__main__":
    run_service(Worker)
