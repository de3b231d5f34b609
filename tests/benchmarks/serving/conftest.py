"""The services' tiny random-weight model (SmolLM2 vocabulary), which radixserve loads in
seconds: the end-to-end peer test serves it."""

from tests.services.conftest import tiny_llama_dir  # noqa: F401
