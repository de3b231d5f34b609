"""The detokenizer process: token ids in, safe text deltas out (`python -m services.detokenizer`)."""
