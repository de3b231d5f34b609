"""The tokenizer service: API requests to token ids in, engine results to API responses out."""
