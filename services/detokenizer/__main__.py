"""`python -m services.detokenizer [flags]`: flags and RADIXSERVE_* variables as in `Settings`."""

from services.detokenizer.detokenizer import Detokenizer
from services.process import run_service

if __name__ == "__main__":
    run_service(Detokenizer)
