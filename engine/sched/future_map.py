"""The future-token ledger that lets the scheduler build batch N+1 while batch N runs.

Batch N+1's decode inputs are the tokens batch N is still sampling. Instead of waiting,
the scheduler writes a *future* in their place — `-req_pool_idx` — and batch N's sampler
stores its tokens at `output_tokens_buf[req_pool_idx]` on the forward side. Batch N+1
resolves its futures there, on the forward side too: the scheduler never touches token
values it does not need yet.
"""

from __future__ import annotations

import torch


class FutureMap:
    def __init__(self, max_running_requests: int, device: torch.device, debug: bool = False):
        self.debug = debug
        self.output_tokens_buf = torch.full(
            (max_running_requests + 1,), -1 if debug else 0, dtype=torch.int64, device=device
        )

    @staticmethod
    def futures(req_pool_indices: torch.Tensor) -> torch.Tensor:
        """Placeholders for the next tokens of these rows (row ids are ≥ 1, so futures < 0)."""
        return -req_pool_indices

    def store(self, req_pool_indices: torch.Tensor, next_token_ids: torch.Tensor) -> None:
        self.output_tokens_buf[req_pool_indices] = next_token_ids

    def resolve(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Swap every future in `input_ids` for the token stored under its row.

        In debug mode the buffer starts poisoned (-1), every read entry is poisoned again,
        and a read of a poisoned entry — a future read before it was written — raises.
        """
        is_future = input_ids < 0
        rows = torch.where(is_future, -input_ids, 0)
        resolved = torch.where(is_future, self.output_tokens_buf[rows], input_ids)
        if self.debug:
            if bool((resolved < 0).any()):
                raise RuntimeError(
                    f"future token read before it was written: rows {rows[resolved < 0].tolist()}"
                )
            self.output_tokens_buf[rows[is_future]] = -1
        return resolved
