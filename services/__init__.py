"""The tokenizer, worker and detokenizer processes and what joins them."""
