"""The detokenizer process: token ids in, safe text deltas out.

Run it with `python -m services.detokenizer`.
"""
