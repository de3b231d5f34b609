"""The decoding requests and their per-request state, kept as arrays from step to step.

Why: a decode step of 256 requests must not read 256 Python objects a dozen times to lay
out its tensors. The running batch keeps each request's row of `req_to_token`, its KV
length and its sampling parameters as host arrays (and the sampling parameters also as
device tensors); a step only adds one to the lengths. When requests join or leave, the
arrays are concatenated or filtered with one index op per field — SGLang's
`ScheduleBatch.merge_batch` / `filter_batch`. `check_consistent` compares them with a
rebuild from the requests: the tests' proof that no update was missed.

Membership changes rebind the arrays rather than write into them, so a batch that was laid
out from them (and may still be running under the overlap loop) keeps what it read.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence

import torch

from engine.sampling.sampling_batch_info import SamplingBatchInfo, SamplingRows
from engine.sched.cache_manager import req_row
from engine.sched.future_map import FutureMap
from engine.sched.req import Req


class RunningBatch:
    """`reqs` in batch order; row i of every array belongs to `reqs[i]`.

    `seq_lens[i]` is `reqs[i].kv.allocated_len`: the tokens that have a KV slot, which is
    where the next decode step writes. `num_req_state` counts the requests whose sampling
    also reads their tokens (penalties, min-tokens, seeds, logit_bias) or a grammar: with
    none, a decode step reuses one `SamplingBatchInfo` until the membership changes.
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._set([], _ints([]), _ints([]), SamplingRows.from_params([], vocab_size))

    def _set(
        self,
        reqs: list[Req],
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        sampling_rows: SamplingRows,
    ) -> None:
        self.reqs = reqs
        self.req_pool_indices = req_pool_indices
        self.seq_lens = seq_lens
        self.sampling_rows = sampling_rows
        self.num_req_state = int(sampling_rows.needs_req_state.sum()) + sum(
            r.grammar.matcher is not None for r in reqs
        )
        # Derived once per membership: what every decode step of these requests reuses.
        self.futures = FutureMap.futures(req_pool_indices)
        self.ones = torch.ones(len(reqs), dtype=torch.int64)
        self.ones_list = [1] * len(reqs)
        self._sampling_info: SamplingBatchInfo | None = None

    # ----- reading ----------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.reqs)

    def __bool__(self) -> bool:
        return bool(self.reqs)

    def __iter__(self) -> Iterator[Req]:
        return iter(self.reqs)

    def __contains__(self, req: object) -> bool:
        return any(r is req for r in self.reqs)

    def sampling_info(self) -> SamplingBatchInfo:
        """The parameters-only sampling state of these requests, shared by every step until
        the membership changes; callers must not modify it."""
        if self._sampling_info is None:
            self._sampling_info = SamplingBatchInfo.from_rows(
                self.sampling_rows, self.vocab_size, self.device
            )
        return self._sampling_info

    # ----- changing ---------------------------------------------------------------------

    def add(self, reqs: Sequence[Req]) -> None:
        """`reqs` join at the end, each holding its row and its KV so far."""
        if not reqs:
            return
        rows = SamplingRows.from_params([r.sampling_params for r in reqs], self.vocab_size)
        self._set(
            self.reqs + list(reqs),
            torch.cat([self.req_pool_indices, _ints([req_row(r) for r in reqs])]),
            torch.cat([self.seq_lens, _ints([r.kv.allocated_len for r in reqs])]),
            self.sampling_rows.cat(rows),
        )

    def remove(self, reqs: Collection[Req]) -> None:
        """`reqs` (some of them perhaps not here) leave; the rest keep their order."""
        if not reqs:
            return
        leaving = {id(r) for r in reqs}
        self.keep([i for i, r in enumerate(self.reqs) if id(r) not in leaving])

    def keep(self, positions: list[int]) -> None:
        """Keep only the requests at these positions of `reqs`, in that order."""
        if len(positions) == len(self.reqs):
            return
        index = _ints(positions)
        self._set(
            [self.reqs[i] for i in positions],
            self.req_pool_indices.index_select(0, index),
            self.seq_lens.index_select(0, index),
            self.sampling_rows.select(index),
        )

    def advance(self) -> None:
        """A batch gave every request one more KV slot (a decode, or the decodes of a mixed
        batch)."""
        self.seq_lens = self.seq_lens + 1

    def resync_lens(self) -> None:
        """A verify batch gave each request as many KV slots as it accepted tokens."""
        self.seq_lens = _ints([r.kv.allocated_len for r in self.reqs])

    # ----- checking ---------------------------------------------------------------------

    def check_consistent(self) -> None:
        """Raise AssertionError unless every array equals a rebuild from the requests."""
        fresh = RunningBatch(self.vocab_size, self.device)
        fresh.add(self.reqs)
        for name in ("req_pool_indices", "seq_lens", "futures", "ones"):
            mine, theirs = getattr(self, name), getattr(fresh, name)
            if not torch.equal(mine, theirs):
                raise AssertionError(f"running batch {name} {mine.tolist()} != {theirs.tolist()}")
        if self.ones_list != fresh.ones_list or self.num_req_state != fresh.num_req_state:
            raise AssertionError("running batch counts differ from its requests")
        for name, mine in vars(self.sampling_rows).items():
            theirs = getattr(fresh.sampling_rows, name)
            if not torch.equal(mine, theirs):
                raise AssertionError(f"running batch sampling {name} differs from its requests")
        if self._sampling_info is not None:
            cached, rebuilt = self._sampling_info, fresh.sampling_info()
            for name, value in vars(rebuilt).items():
                other = getattr(cached, name)
                same = (
                    torch.equal(value.cpu(), other.cpu())
                    if isinstance(value, torch.Tensor)
                    else value == other
                )
                if not same:
                    raise AssertionError(f"cached sampling info {name} is stale")


def _ints(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)
