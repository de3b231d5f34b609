"""The building blocks the models are assembled from (names follow SGLang and vLLM)."""
