"""The portable attention backend over K/V gathered from the pool: one SDPA call per
multi-token request, two batched matmuls for all one-token requests together."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from engine.kernels.cpu import build as cpu_build
from engine.kernels.cpu import ops as cpu_ops
from engine.model.attention.base import AttentionBackend, AttentionLayer, CpuDecodeInputs
from engine.model.forward_batch import ForwardBatch


@dataclass
class ExtendSeq:
    """One request with several new tokens: its queries are `q[start:end]`, its keys the
    pool slots `kv_indices` (prefix, then the new tokens)."""

    start: int
    end: int
    kv_indices: torch.Tensor  # [seq_len] int64
    mask: torch.Tensor | None  # [extend_len, seq_len] bool; None: no prefix, plain causal


@dataclass
class ExtendGroup:
    """All multi-token requests of a bf16 batch as the C++ extend kernel reads them, where
    AMX runs it (`cpu_ops.extend_attention`)."""

    slots: torch.Tensor  # [n, longest] int64: each request's prefix slots, then its new ones
    prefix_lens: torch.Tensor  # [n] int64
    extend_lens: torch.Tensor  # [n] int64
    q_starts: torch.Tensor  # [n] int64: the row of q where each request's new tokens start
    window: int = 0
    """The layer's sliding window as the kernel takes it (0: none)."""


@dataclass
class TorchDecodeRows:
    """What the torch-ops decode reads: keys gathered head-major (row (r, h, j) of the
    gather is KV head h of request r's j-th key), values read in place."""

    # [n * kv_heads * max_seq_len] int64: rows of the pool seen as [slots * kv_heads, head_dim]
    kv_rows: torch.Tensor
    # [n * num_heads, max_seq_len] int64: for each query head, the pool rows of its KV head
    v_rows: torch.Tensor
    bias: torch.Tensor  # [n, 1, max_seq_len] float: 0 for a key, -inf for padding


@dataclass
class DecodeGroup:
    """All requests with one new token, attended together. The C++ kernel reads `slots`
    and `seq_lens` alone; the torch ops read `rows`, built only for them."""

    token_indices: torch.Tensor | None  # [n] rows of q; None: every row, in order
    slots: torch.Tensor  # [n, max_seq_len] int64: each request's slots, stale past its length
    seq_lens: torch.Tensor  # [n] int64
    rows: TorchDecodeRows | None  # None when the C++ kernel attends
    max_seq_len: int
    slot_index: torch.Tensor | None = None
    """[n] int64: the row of `slots` each query reads (the C++ kernel only); None: its own."""
    window: int = 0
    """The C++ kernel reads only the last `window` keys of each query (0: all of them); the
    torch ops' rows are built over the window instead (`window_group`)."""


@dataclass
class ForwardMetadata:
    extend_seqs: list[ExtendSeq]
    decode: DecodeGroup | None
    extend_group: ExtendGroup | None = None
    """Set instead of `extend_seqs`' masks when the C++ extend kernel attends."""
    opaque_decode: bool = False
    """Decode through the `radixserve::decode_attention` op, which builds its own group:
    under `torch.compile`, where the group's size (the batch's longest context) must not
    reach the compiled graph."""
    captured: bool = False
    """Built for a captured graph (`init_forward_metadata_graph`): its layers go through
    `forward`, which the graph backend records."""
    out_cache_loc: torch.Tensor | None = None
    """The new tokens' rows of this metadata's pool where they are not the batch's
    `out_cache_loc` (a variant over the SWA pool)."""
    swa: ForwardMetadata | None = None
    """This metadata with every slot translated into the SWA pool's rows (a hybrid model's
    two pools), as the mapping stood when the slot tables were read: under the overlap
    loop the scheduler frees and moves SWA slots of the batch's requests while it runs."""
    windows: dict[tuple[int | None, bool], ForwardMetadata] = field(default_factory=dict)
    """This batch's metadata for each (sliding window, over the SWA pool) its layers use
    other than (None, False), built from this one (or `swa`) at the first such layer
    (`window_metadata`)."""


class TorchAttnBackend(AttentionBackend):
    """The CPU default. Keys are read through `req_to_token` for each request's prefix and
    from `out_cache_loc` for its new tokens (whose table entries the scheduler may not have
    written yet), exactly the slots the Triton backend reads.

    Every index tensor and mask is built once per batch in `init_forward_metadata`; a layer
    only gathers and multiplies, with no device sync. One-token requests (all of a decode
    batch, the riders of a mixed one) share two batched matmuls padded to the longest of
    them (`_attend_decode`). Multi-token requests get one SDPA call each: padding ragged
    prompts to a common length would cost memory quadratic in the longest one, and the
    per-request loop runs once per layer, never per token. Gathers use `index_select`: on
    CPU, advanced indexing with an index tensor goes through a parallel kernel that costs
    milliseconds when the cores are busy.

    Under a graph (`init_forward_metadata_graph`) a decode batch attends over whole
    `req_to_token` rows, `max_context_len` keys each with those past its length masked:
    the one key count that fits every batch a graph replays. It is for graph backends
    that replay Python (the CPU tests); eager decode pads only to the batch's longest.

    On CPU, decode attention runs in a C++ kernel that reads keys and values in place
    (`engine/kernels/cpu`) where it can be built, and so does the prefill of a bf16 batch where the
    CPU has AMX (head_dim a multiple of 64): one call for all its multi-token requests, the
    products on tiles, where SDPA takes them at float speed. `cpu_kernel=False` keeps the
    torch ops.

    `batch_invariant` (--enable-deterministic-inference, the C++ kernel only): every token
    of an extend batch attends as a one-token query of the decode kernel over its request's
    first `position + 1` keys (`_token_group`), so a token's attention is summed in the one
    order a decode step sums it, whether its keys came from the radix cache, an earlier
    chunk, this extend or decode steps (a retracted request's re-prefill); and
    `cpu_decode_inputs` lets every batch, not only decode ones, run its layers as one op
    where the model can.

    A layer with a `sliding_window` attends through a variant of the batch's metadata,
    built once per batch and window at the first such layer (`_metadata`): the C++ kernels
    take the window and skip the keys before it; the torch ops get each request's keys from
    its window's first one (`window_extend_seq`, `window_group`). No path reads a key
    before a query's window, so that KV may be freed. Where the pool keeps the layer's K/V
    in a pool of its own (`SWAKVPool.slot_map`), the variant starts from the batch's slots
    translated into that pool's rows when its metadata was built (`ForwardMetadata.swa`).
    """

    batch_invariant = False

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: str | torch.device,
        cpu_kernel: bool = True,
    ):
        super().__init__(num_heads, num_kv_heads, head_dim, device)
        self.cpu_kernel = (
            cpu_kernel and torch.device(device).type == "cpu" and cpu_build.available()
        )
        self.amx_extend = (
            self.cpu_kernel and head_dim % 64 == 0 and cpu_ops.extend_attention_available()
        )
        self.forward_metadata: ForwardMetadata | None = None
        self.graph_max_seq_len = 0
        self.graph_static_shapes = True

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        self.forward_metadata = self._with_swa(self._forward_metadata(forward_batch), forward_batch)

    def _with_swa(self, md: ForwardMetadata, fb: ForwardBatch) -> ForwardMetadata:
        """`md` and, over a hybrid model's two pools, its SWA translation, made now, in the
        same step that read the slot tables."""
        slot_map = fb.token_to_kv_pool.swa_slot_map()
        if slot_map is not None:
            md.swa = translate_metadata(
                md, slot_map, fb.out_cache_loc, self.num_heads, self.num_kv_heads
            )
        return md

    def _forward_metadata(self, fb: ForwardBatch) -> ForwardMetadata:
        if fb.forward_mode.is_decode():  # one decode group, without a pass over the requests
            group = self._decode_group(
                fb, fb.req_pool_indices, fb.seq_lens, fb.out_cache_loc, max(fb.seq_lens_cpu)
            )
            return ForwardMetadata([], group)
        if fb.forward_mode.is_verify():
            return ForwardMetadata([], self._tree_group(fb))
        if self.batch_invariant:
            return ForwardMetadata([], self._token_group(fb))
        extend_kernel = self.amx_extend and fb.token_to_kv_pool.dtype == torch.bfloat16
        extend_seqs, single, single_starts, start = [], [], [], 0
        prefix_slots: torch.Tensor | None = None
        for i, (prefix_len, extend_len) in enumerate(zip(fb.prefix_lens_cpu, fb.extend_lens_cpu)):
            end = start + extend_len
            if extend_len == 1:
                single.append(i)
                single_starts.append(start)
            else:
                if prefix_slots is None:
                    prefix_slots = self._prefix_slots(fb)
                kv_indices = torch.cat((prefix_slots[i, :prefix_len], fb.out_cache_loc[start:end]))
                mask = None if extend_kernel else self._prefix_causal_mask(prefix_len, extend_len)
                extend_seqs.append(ExtendSeq(start, end, kv_indices, mask))
            start = end
        extend_group = None
        if extend_kernel and extend_seqs:
            extend_group = self._extend_group(fb, extend_seqs)
        decode = None
        if single:
            req_indices = torch.tensor(single, device=self.device)
            token_indices = torch.tensor(single_starts, device=self.device)
            decode = self._decode_group(
                fb,
                fb.req_pool_indices[req_indices],
                fb.seq_lens[req_indices],
                fb.out_cache_loc[token_indices],
                max(fb.seq_lens_cpu[i] for i in single),
                token_indices,
            )
        return ForwardMetadata(extend_seqs, decode, extend_group)

    def _token_group(self, fb: ForwardBatch) -> DecodeGroup:
        """Every new token of an extend batch as one row of the decode kernel: token i of
        request r reads row r of `slots` (its prefix's table entries, then its new tokens'
        slots, which the table may not hold yet) up to its position."""
        max_seq_len = max(fb.seq_lens_cpu)
        slots = fb.req_to_token_pool.req_to_token[:, :max_seq_len]
        slots = slots.index_select(0, fb.req_pool_indices).long()
        token_req = torch.repeat_interleave(
            torch.arange(len(fb.extend_lens_cpu), device=self.device), fb.extend_lens
        )
        slots.index_put_((token_req, fb.positions), fb.out_cache_loc.long())
        return DecodeGroup(None, slots, fb.positions + 1, None, max_seq_len, token_req)

    def _tree_group(self, fb: ForwardBatch) -> DecodeGroup:
        """Every node of a verify batch's draft trees as one row of the decode group, with
        a row of slots of its own: its request's prefix, then the slots of its path from
        the root (`tree_ancestors`) at the positions they take if accepted. A node thus
        attends exactly as a decode step at its position would, over the same keys in the
        same order: siblings and their subtrees stay out of sight."""
        assert fb.tree_ancestors is not None, "a verify batch carries its trees"
        max_seq_len = max(fb.seq_lens_cpu)
        token_req = torch.repeat_interleave(
            torch.arange(fb.batch_size, device=self.device),
            fb.extend_lens,
            output_size=len(fb.out_cache_loc),
        )
        table = fb.req_to_token_pool.req_to_token[:, :max_seq_len]
        slots = table.index_select(0, fb.req_pool_indices.index_select(0, token_req)).long()
        ancestors = fb.tree_ancestors
        token, depth = (ancestors >= 0).nonzero(as_tuple=True)
        column = fb.prefix_lens.index_select(0, token_req.index_select(0, token)) + depth
        path = fb.out_cache_loc.index_select(0, ancestors[token, depth]).long()
        slots.index_put_((token, column), path)
        return group_over_slots(
            slots,
            fb.positions + 1,
            max_seq_len,
            self.num_heads,
            self.num_kv_heads,
            self.cpu_kernel,
        )

    def _extend_group(self, fb: ForwardBatch, extend_seqs: list[ExtendSeq]) -> ExtendGroup:
        extend_lens = [seq.end - seq.start for seq in extend_seqs]
        seq_lens = [len(seq.kv_indices) for seq in extend_seqs]
        return ExtendGroup(
            torch.nn.utils.rnn.pad_sequence([seq.kv_indices for seq in extend_seqs], True),
            torch.tensor([n - e for n, e in zip(seq_lens, extend_lens)], device=self.device),
            torch.tensor(extend_lens, device=self.device),
            torch.tensor([seq.start for seq in extend_seqs], device=self.device),
        )

    def init_cuda_graph_state(
        self, max_bs: int, max_context_len: int, static_shapes: bool = True
    ) -> None:
        self.graph_max_seq_len = max_context_len
        self.graph_static_shapes = static_shapes

    def init_forward_metadata_graph(self, forward_batch: ForwardBatch) -> None:
        if not self.graph_static_shapes:
            self.forward_metadata = ForwardMetadata([], None, opaque_decode=True)
            return
        fb = forward_batch
        decode = self._decode_group(
            fb, fb.req_pool_indices, fb.seq_lens, fb.out_cache_loc, self.graph_max_seq_len
        )
        self.forward_metadata = self._with_swa(ForwardMetadata([], decode, captured=True), fb)

    def cpu_decode_inputs(
        self, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> CpuDecodeInputs | None:
        md = self.forward_metadata
        if md is None or md.captured or md.extend_seqs:
            return None
        md = self._metadata(layer, forward_batch)
        decode = md.decode
        out_cache_loc = (
            forward_batch.out_cache_loc if md.out_cache_loc is None else md.out_cache_loc
        )
        if self.batch_invariant and decode is not None:  # every batch: decode rows or tokens
            k_buffer, v_buffer = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
            return CpuDecodeInputs(
                k_buffer,
                v_buffer,
                out_cache_loc,
                decode.slots,
                decode.seq_lens,
                decode.slot_index,
                batch_invariant=True,
                window=decode.window,
            )
        if decode is None or decode.rows is not None or decode.token_indices is not None:
            return None
        k_buffer, v_buffer = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        return CpuDecodeInputs(
            k_buffer,
            v_buffer,
            out_cache_loc,
            decode.slots,
            decode.seq_lens,
            window=decode.window,
        )

    def _metadata(self, layer: AttentionLayer, forward_batch: ForwardBatch) -> ForwardMetadata:
        """The batch's metadata as `layer` attends: the full one, or its variant for the
        layer's sliding window and pool, built at the first layer of the batch with them."""
        md = self.forward_metadata
        assert md is not None, "init_forward_metadata runs before the first layer"
        window = layer.sliding_window
        in_swa_pool = forward_batch.token_to_kv_pool.slot_map(layer.layer_id) is not None
        if window is None and not in_swa_pool:
            return md
        key = (window, in_swa_pool)
        variant = md.windows.get(key)
        if variant is None:
            base = md.swa if in_swa_pool else md
            assert base is not None, "an SWA pool's batch has its translation"
            variant = window_metadata(base, window, self.num_heads, self.num_kv_heads)
            md.windows[key] = variant
        return variant

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        md = self.forward_metadata
        if md is None or not md.opaque_decode:
            return super().forward(q, k, v, layer, forward_batch)
        fb = forward_batch
        k_buffer, v_buffer = fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        out: torch.Tensor = torch.ops.radixserve.decode_attention(
            q,
            k,
            v,
            k_buffer,
            v_buffer,
            fb.req_to_token_pool.req_to_token,
            fb.req_pool_indices,
            fb.seq_lens,
            fb.out_cache_loc,
            layer.num_kv_heads,
            layer.scaling,
            self.cpu_kernel,
            layer.sliding_window or 0,
            fb.token_to_kv_pool.slot_map(layer.layer_id),
        )
        return out

    def forward_extend(
        self, q: torch.Tensor, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        md = self._metadata(layer, forward_batch)
        k_buffer, v_buffer = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        extend = md.extend_group
        if extend is not None:  # the pool is bf16, and so are the activations
            out = cpu_ops.extend_attention(
                q,
                k_buffer,
                v_buffer,
                extend.slots,
                extend.prefix_lens,
                extend.extend_lens,
                extend.q_starts,
                layer.scaling,
                extend.window,
            )
        else:
            out = torch.empty_like(q)
            for seq in md.extend_seqs:
                keys = k_buffer.index_select(0, seq.kv_indices).to(q.dtype)
                values = v_buffer.index_select(0, seq.kv_indices).to(q.dtype)
                out[seq.start : seq.end] = F.scaled_dot_product_attention(
                    q[seq.start : seq.end].transpose(0, 1).unsqueeze(0),
                    keys.transpose(0, 1).unsqueeze(0),
                    values.transpose(0, 1).unsqueeze(0),
                    attn_mask=seq.mask,
                    is_causal=seq.mask is None,
                    scale=layer.scaling,
                    enable_gqa=True,
                )[0].transpose(0, 1)
        group = md.decode
        if group is not None:
            rows = group.token_indices
            if rows is None:
                return self._attend_decode(q, layer, forward_batch, group)
            out.index_copy_(
                0, rows, self._attend_decode(q.index_select(0, rows), layer, forward_batch, group)
            )
        return out

    def forward_decode(
        self, q: torch.Tensor, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        md = self._metadata(layer, forward_batch)
        assert md.decode is not None, "a decode batch has a decode group"
        return self._attend_decode(q, layer, forward_batch, md.decode)

    def _attend_decode(
        self,
        q: torch.Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        group: DecodeGroup,
    ) -> torch.Tensor:
        """The C++ kernel where it was built (`engine/kernels/cpu`). Otherwise torch ops: scores
        by one batched matmul over keys gathered head-major, so that each
        (request, KV head) is one contiguous `[max_seq_len, head_dim]` block that bmm reads
        in place; the query heads sharing a KV head are that block's queries (no GQA
        expansion). The weighted sum of values reads them in place in the pool, through
        `v_rows`: `embedding_bag` with the probabilities as per-sample weights is exactly
        `probs @ V[rows]` without the copy (benchmarks/attention_bench.py --device cpu).
        SDPA is slower here on CPU (its flash kernel tiles for long queries, not 1-3 of
        them) and slower still over the strided `[seq, kv_heads, dim]` pool layout."""
        k_buffer, v_buffer = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        return attend_decode(q, k_buffer, v_buffer, group, layer.num_kv_heads, layer.scaling)

    def _prefix_causal_mask(self, prefix_len: int, extend_len: int) -> torch.Tensor | None:
        """New token i sees the whole prefix and new tokens 0..i; None when there is no
        prefix, where SDPA's own causal mask is the same thing."""
        if prefix_len == 0:
            return None
        keys = torch.arange(prefix_len + extend_len, device=self.device)
        queries = torch.arange(prefix_len, prefix_len + extend_len, device=self.device)
        return keys[None, :] <= queries[:, None]

    def _prefix_slots(self, fb: ForwardBatch) -> torch.Tensor:
        """`[batch, longest prefix]` int64: each request's prefix slots from its table row."""
        max_prefix_len = max(fb.prefix_lens_cpu)
        req_to_token = fb.req_to_token_pool.req_to_token[:, :max_prefix_len]
        return req_to_token.index_select(0, fb.req_pool_indices).long()

    def _decode_group(
        self,
        fb: ForwardBatch,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        out_cache_loc: torch.Tensor,
        max_seq_len: int,
        token_indices: torch.Tensor | None = None,
    ) -> DecodeGroup:
        return decode_group(
            fb.req_to_token_pool.req_to_token,
            req_pool_indices,
            seq_lens,
            out_cache_loc,
            max_seq_len,
            self.num_heads,
            self.num_kv_heads,
            self.cpu_kernel,
            token_indices,
        )


def decode_group(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    max_seq_len: int,
    num_heads: int,
    num_kv_heads: int,
    cpu_kernel: bool,
    token_indices: torch.Tensor | None = None,
) -> DecodeGroup:
    """Row r holds request r's first `max_seq_len` table entries with its new token's slot
    put at column `seq_len - 1`; entries past it are stale (any table entry is a valid
    slot): the kernel stops at the length, the torch ops' bias hides them. For the torch
    ops each slot then becomes its `num_kv_heads` rows of the pool. Static shapes only, so
    a graph can replay it."""
    slots = req_to_token[:, :max_seq_len].index_select(0, req_pool_indices).long()
    slots.scatter_(1, (seq_lens - 1)[:, None], out_cache_loc[:, None])
    return group_over_slots(
        slots, seq_lens, max_seq_len, num_heads, num_kv_heads, cpu_kernel, token_indices
    )


def group_over_slots(
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    num_heads: int,
    num_kv_heads: int,
    cpu_kernel: bool,
    token_indices: torch.Tensor | None = None,
) -> DecodeGroup:
    """One-token queries over rows of slots, query r reading the first `seq_lens[r]` of
    row r: as the C++ kernel reads them, or with the torch ops' gather rows and padding."""
    device = slots.device
    if cpu_kernel:
        return DecodeGroup(token_indices, slots, seq_lens, None, max_seq_len)
    heads = torch.arange(num_kv_heads, device=device)
    kv_rows = slots[:, None, :] * num_kv_heads + heads[None, :, None]
    group_size = num_heads // num_kv_heads
    v_rows = kv_rows[:, :, None, :].expand(-1, -1, group_size, -1).reshape(-1, max_seq_len)
    padding = torch.arange(max_seq_len, device=device)[None, :] >= seq_lens[:, None]
    bias = torch.zeros(padding.shape, device=device).masked_fill_(padding, float("-inf"))
    rows = TorchDecodeRows(kv_rows.view(-1), v_rows, bias[:, None, :])
    return DecodeGroup(token_indices, slots, seq_lens, rows, max_seq_len)


def window_metadata(
    md: ForwardMetadata, window: int | None, num_heads: int, num_kv_heads: int
) -> ForwardMetadata:
    """`md` for a layer with a sliding `window` (None: none, `md` itself): the kernels'
    groups carry the window, the torch ops' requests are cut to it."""
    if window is None:
        return md
    extend_seqs, decode, extend_group = md.extend_seqs, md.decode, md.extend_group
    if extend_group is None:  # SDPA reads every key it is given
        extend_seqs = [window_extend_seq(seq, window) for seq in extend_seqs]
    else:
        extend_group = replace(extend_group, window=window)
    if decode is not None:
        decode = window_group(decode, window, num_heads, num_kv_heads)
    return ForwardMetadata(
        extend_seqs,
        decode,
        extend_group,
        opaque_decode=md.opaque_decode,
        captured=md.captured,
        out_cache_loc=md.out_cache_loc,
    )


def translate_metadata(
    md: ForwardMetadata,
    slot_map: torch.Tensor,
    out_cache_loc: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> ForwardMetadata:
    """`md` over the rows `slot_map` turns its slots into (a slot out of every window,
    whose SWA KV is gone, becomes the padding row, which no window reads)."""
    extend_group, decode = md.extend_group, md.decode
    return ForwardMetadata(
        [replace(seq, kv_indices=slot_map[seq.kv_indices]) for seq in md.extend_seqs],
        None if decode is None else translate_group(decode, slot_map, num_heads, num_kv_heads),
        None if extend_group is None else replace(extend_group, slots=slot_map[extend_group.slots]),
        opaque_decode=md.opaque_decode,
        captured=md.captured,
        out_cache_loc=slot_map[out_cache_loc],
    )


def translate_group(
    group: DecodeGroup, slot_map: torch.Tensor, num_heads: int, num_kv_heads: int
) -> DecodeGroup:
    """`group` over the rows `slot_map` gives its slots (the torch ops' gather rows rebuilt
    from them). Static shapes only, so a graph can replay it."""
    slots = slot_map[group.slots]
    if group.rows is None:
        return replace(group, slots=slots)
    return group_over_slots(
        slots,
        group.seq_lens,
        group.max_seq_len,
        num_heads,
        num_kv_heads,
        cpu_kernel=False,
        token_indices=group.token_indices,
    )


def window_extend_seq(seq: ExtendSeq, window: int) -> ExtendSeq:
    """`seq` under a sliding window: its keys from the first one its first new token sees,
    with the mask of (p - window, p] over them; `seq` itself where the window holds it all."""
    seq_len = len(seq.kv_indices)
    prefix_len = seq_len - (seq.end - seq.start)
    if seq_len <= window:
        return seq
    first = max(prefix_len + 1 - window, 0)
    device = seq.kv_indices.device
    keys = torch.arange(first, seq_len, device=device)[None, :]
    queries = torch.arange(prefix_len, seq_len, device=device)[:, None]
    mask = (keys <= queries) & (keys > queries - window)
    return ExtendSeq(seq.start, seq.end, seq.kv_indices[first:], mask)


def window_group(group: DecodeGroup, window: int, num_heads: int, num_kv_heads: int) -> DecodeGroup:
    """`group` under a sliding window. The C++ kernel clips each query's keys itself. The
    torch ops get rows over each query's last `window` slots only, padded with slot 0 (which
    the pools reserve), so that no key before a window is gathered. Static shapes only, so
    a graph can replay it."""
    if group.rows is None:
        return replace(group, window=window)
    if window >= group.max_seq_len:  # no query has a key before its window
        return group
    first = (group.seq_lens - window).clamp_(min=0)
    columns = first[:, None] + torch.arange(window, device=first.device)[None, :]
    inside = columns < group.seq_lens[:, None]
    slots = group.slots.gather(1, columns.clamp_(max=group.max_seq_len - 1))
    return group_over_slots(
        slots.masked_fill_(~inside, 0),
        group.seq_lens - first,
        window,
        num_heads,
        num_kv_heads,
        cpu_kernel=False,
        token_indices=group.token_indices,
    )


def attend_decode(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    group: DecodeGroup,
    num_kv_heads: int,
    scaling: float,
) -> torch.Tensor:
    """`[n, num_heads, head_dim]` attention of one-token queries `q` over `group`."""
    rows = group.rows
    if rows is None:
        return cpu_ops.decode_attention(
            q,
            k_buffer,
            v_buffer,
            group.slots,
            group.seq_lens,
            scaling,
            group.slot_index,
            group.window,
        )
    num_reqs, num_heads, d = q.shape
    blocks = (num_reqs * num_kv_heads, group.max_seq_len, d)
    k = k_buffer.view(-1, d).index_select(0, rows.kv_rows).view(blocks).to(q.dtype)
    queries = q.reshape(blocks[0], num_heads // num_kv_heads, d)
    scores = torch.bmm(queries, k.transpose(1, 2)).view(num_reqs, num_heads, group.max_seq_len)
    scores = scores.to(torch.promote_types(q.dtype, torch.float32)).mul_(scaling).add_(rows.bias)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    if v_buffer.dtype != q.dtype:  # a 16-bit pool under float32: values gathered and widened
        values = v_buffer.view(-1, d).index_select(0, rows.kv_rows).view(blocks).to(q.dtype)
        return torch.bmm(probs.view(blocks[0], -1, group.max_seq_len), values).view(q.shape)
    out = F.embedding_bag(
        rows.v_rows,
        v_buffer.view(-1, d),
        mode="sum",
        per_sample_weights=probs.view(rows.v_rows.shape),
    )
    return out.view(num_reqs, num_heads, d)


@torch.library.custom_op("radixserve::decode_attention", mutates_args=("k_buffer", "v_buffer"))
def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    num_kv_heads: int,
    scaling: float,
    cpu_kernel: bool,
    window: int,
    slot_map: torch.Tensor | None,
) -> torch.Tensor:
    """One layer's decode step as a single op that `torch.compile` does not look into: it
    writes the new tokens' K/V, then attends over the batch's longest context, a size read
    from `seq_lens` at run time (inside a compiled graph it would be baked in); `window`:
    the layer's sliding window (0: none); `slot_map`: what turns slots into rows of the
    layer's buffers (`SWAKVPool.slot_map`; None: they are rows)."""
    rows = out_cache_loc if slot_map is None else slot_map[out_cache_loc]
    k_buffer.index_copy_(0, rows, k.to(k_buffer.dtype))
    v_buffer.index_copy_(0, rows, v.to(v_buffer.dtype))
    max_seq_len = int(seq_lens.max())
    group = decode_group(
        req_to_token,
        req_pool_indices,
        seq_lens,
        out_cache_loc,
        max_seq_len,
        q.shape[1],
        num_kv_heads,
        cpu_kernel,
    )
    if window > 0:
        group = window_group(group, window, q.shape[1], num_kv_heads)
    if slot_map is not None:
        group = translate_group(group, slot_map, q.shape[1], num_kv_heads)
    return attend_decode(q, k_buffer, v_buffer, group, num_kv_heads, scaling)


@decode_attention.register_fake
def _(q: torch.Tensor, *args: object) -> torch.Tensor:
    return torch.empty_like(q)
