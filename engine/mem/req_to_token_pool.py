"""First level of the page table: request row → the KV slot of each of its tokens."""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """An int32 table `req_to_token[row, i]` = KV slot of token i of the request in `row`.

    Row 0 is the padding row: padded (fake) requests in a captured batch point at it, so
    their reads and writes land somewhere harmless. Real rows are 1..size.
    """

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu"):
        if size < 1 or max_context_len < 1:
            raise ValueError(
                "ReqToTokenPool needs size >= 1 and max_context_len >= 1, "
                f"got {size}, {max_context_len}"
            )
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros(
            (size + 1, max_context_len), dtype=torch.int32, device=self.device
        )
        self.free_slots: list[int] = list(range(1, size + 1))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, need_size: int = 1) -> list[int] | None:
        """Take `need_size` rows, or return None when fewer are free."""
        if need_size > len(self.free_slots):
            return None
        rows, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        return rows

    def free(self, rows: int | list[int]) -> None:
        rows = [rows] if isinstance(rows, int) else rows
        for row in rows:
            if not 1 <= row <= self.size:
                raise ValueError(f"row {row} is not a request row of this pool (1..{self.size})")
        self.free_slots.extend(rows)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Point tokens [start, start + len(slots)) of `row` at `slots`."""
        end = start + len(slots)
        if end > self.max_context_len:
            raise ValueError(
                f"request row of {end} tokens exceeds max_context_len {self.max_context_len}"
            )
        self.req_to_token[row, start:end] = slots.to(torch.int32)

    def clear(self) -> None:
        self.free_slots = list(range(1, self.size + 1))
