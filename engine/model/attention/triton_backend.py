"""The GPU attention backend: Triton extend and split-KV decode kernels over the KV pool."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.kernels.triton.decode_attention import decode_attention_fwd
from engine.kernels.triton.extend_attention import extend_attention_fwd
from engine.model.attention.base import AttentionBackend, AttentionLayer
from engine.model.forward_batch import ForwardBatch


@dataclass
class DecodeMetadata:
    """A decode batch's split counts and the buffers for the splits' partial results; the
    kernel reads keys through `req_to_token` and the batch's own tensors."""

    num_kv_splits: torch.Tensor  # [batch] int32
    attn_logits: torch.Tensor  # [batch, heads, max_kv_splits, head_dim] fp32
    attn_lse: torch.Tensor  # [batch, heads, max_kv_splits] fp32
    swa_tables: dict[int | None, SWATable] = field(default_factory=dict)
    """Per sliding window, the batch's keys in the SWA pool (`swa_table`), built at the
    first layer that reads them."""


@dataclass
class SWATable:
    """A decode batch's keys in the SWA pool as the decode kernel reads a table: row i
    holds request i's last `window` slots translated, `seq_lens[i]` of them, the new
    token's at `out_cache_loc[i]`."""

    req_to_token: torch.Tensor  # [batch, window] int32
    req_pool_indices: torch.Tensor  # [batch] int64: arange
    seq_lens: torch.Tensor  # [batch] int64
    out_cache_loc: torch.Tensor  # [batch] int64


@dataclass
class ExtendMetadata:
    """Per-batch index tensors of an extend or mixed batch, built once and shared by every
    layer of the forward pass."""

    # [batch + 1] int32: request i's queries are rows qo_indptr[i]:qo_indptr[i+1]
    qo_indptr: torch.Tensor
    # [batch + 1] int32: request i's keys are kv_indices[kv_indptr[i]:kv_indptr[i+1]]
    kv_indptr: torch.Tensor
    # [sum(seq_lens)] int32 KV slots: prefix from req_to_token, then out_cache_loc
    kv_indices: torch.Tensor
    max_extend_len: int
    swa_kv_indices: torch.Tensor | None = None
    """`kv_indices` in the SWA pool, translated at the first layer that reads them."""


def get_num_kv_splits(
    seq_lens: torch.Tensor, max_kv_splits: int, min_kv_split_len: int
) -> torch.Tensor:
    """Cut each decode request's keys into splits of about `min_kv_split_len`, at most
    `max_kv_splits`, then recount so that none is empty (`cdiv(s, n)` per split can cover
    `s` in fewer than `n` splits once the cap binds). Computed on the device: no sync."""
    wanted = torch.clamp((seq_lens + min_kv_split_len - 1) // min_kv_split_len, 1, max_kv_splits)
    split_len = (seq_lens + wanted - 1) // wanted
    return ((seq_lens + split_len - 1) // split_len).to(torch.int32)


class TritonAttnBackend(AttentionBackend):
    """Attention through Triton kernels; the GPU default, run on CPU only by the interpreter.

    Decode splits each request's keys into `ceil(seq_len / min_kv_split_len)` pieces, at most
    `max_kv_splits`. The count depends on the request's own length alone, never on the rest
    of the batch, so a request's decode output does not change with its batch-mates.

    A layer's sliding window goes to the kernels as an argument: the metadata (and the
    graph's static buffers) serve every layer, windowed or not, and a windowed decode
    recounts its splits over the window inside the kernel. A layer whose K/V live in a
    pool of their own (`SWAKVPool.slot_map`) reads slots translated once per batch: an
    extend's `kv_indices`, a decode's table of each request's last `window` slots.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: str | torch.device,
        max_kv_splits: int = 8,
        min_kv_split_len: int = 64,
    ):
        super().__init__(num_heads, num_kv_heads, head_dim, device)
        self.max_kv_splits = max_kv_splits
        self.min_kv_split_len = min_kv_split_len
        self.forward_metadata: ExtendMetadata | DecodeMetadata | None = None
        self.graph_metadata: DecodeMetadata

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        if fb.forward_mode.is_decode():
            self.forward_metadata = self._decode_metadata(fb.seq_lens)
            return
        qo_indptr = self._indptr(fb.extend_lens)
        kv_indptr = self._indptr(fb.seq_lens)
        self.forward_metadata = ExtendMetadata(
            qo_indptr=qo_indptr,
            kv_indptr=kv_indptr,
            kv_indices=self._kv_indices(fb, qo_indptr, kv_indptr, sum(fb.seq_lens_cpu)),
            max_extend_len=max(fb.extend_lens_cpu, default=0),
        )

    def init_cuda_graph_state(
        self, max_bs: int, max_context_len: int, static_shapes: bool = True
    ) -> None:
        """Split counts and partial-result buffers for `max_bs` requests; each captured
        batch size uses their first rows (static shapes, whatever the graph backend)."""
        self.graph_metadata = self._decode_metadata(
            torch.ones(max_bs, dtype=torch.int64, device=self.device)
        )

    def init_forward_metadata_graph(self, forward_batch: ForwardBatch) -> None:
        bs = forward_batch.seq_lens.shape[0]
        static = self.graph_metadata
        num_kv_splits = static.num_kv_splits[:bs]
        num_kv_splits.copy_(
            get_num_kv_splits(forward_batch.seq_lens, self.max_kv_splits, self.min_kv_split_len)
        )
        self.forward_metadata = DecodeMetadata(
            num_kv_splits, static.attn_logits[:bs], static.attn_lse[:bs]
        )

    def forward_extend(
        self, q: torch.Tensor, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        md = self.forward_metadata
        assert isinstance(md, ExtendMetadata), "init_forward_metadata runs before the first layer"
        k_buffer, v_buffer = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        slot_map = forward_batch.token_to_kv_pool.slot_map(layer.layer_id)
        kv_indices = md.kv_indices
        if slot_map is not None:
            if md.swa_kv_indices is None:
                md.swa_kv_indices = slot_map[kv_indices].to(torch.int32)
            kv_indices = md.swa_kv_indices
        o = torch.empty_like(q)
        extend_attention_fwd(
            q,
            o,
            k_buffer,
            v_buffer,
            md.qo_indptr,
            md.kv_indptr,
            kv_indices,
            md.max_extend_len,
            layer.scaling,
            layer.sliding_window or 0,
        )
        return o

    def forward_decode(
        self, q: torch.Tensor, layer: AttentionLayer, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        md = self.forward_metadata
        assert isinstance(md, DecodeMetadata), "a decode batch has its splits"
        fb = forward_batch
        k_buffer, v_buffer = fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        slot_map = fb.token_to_kv_pool.slot_map(layer.layer_id)
        table = SWATable(
            fb.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens, fb.out_cache_loc
        )
        if slot_map is not None:
            if layer.sliding_window not in md.swa_tables:
                md.swa_tables[layer.sliding_window] = swa_table(fb, slot_map, layer.sliding_window)
            table = md.swa_tables[layer.sliding_window]
        o = torch.empty_like(q)
        decode_attention_fwd(
            q,
            o,
            k_buffer,
            v_buffer,
            table.req_to_token,
            table.req_pool_indices,
            table.seq_lens,
            table.out_cache_loc,
            md.num_kv_splits,
            md.attn_logits,
            md.attn_lse,
            layer.scaling,
            layer.sliding_window or 0,
        )
        return o

    def _decode_metadata(self, seq_lens: torch.Tensor) -> DecodeMetadata:
        shape = (len(seq_lens), self.num_heads, self.max_kv_splits)
        return DecodeMetadata(
            num_kv_splits=get_num_kv_splits(seq_lens, self.max_kv_splits, self.min_kv_split_len),
            attn_logits=torch.empty(
                (*shape, self.head_dim), dtype=torch.float32, device=self.device
            ),
            attn_lse=torch.empty(shape, dtype=torch.float32, device=self.device),
        )

    def _indptr(self, lens: torch.Tensor) -> torch.Tensor:
        indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device=self.device)
        indptr[1:] = torch.cumsum(lens, 0)
        return indptr

    def _kv_indices(
        self, fb: ForwardBatch, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, total_kv: int
    ) -> torch.Tensor:
        """Flatten each request's KV slots: `req_to_token` for its prefix, `out_cache_loc` for
        its new tokens (whose table entries the scheduler may not have written yet)."""
        batch = torch.arange(fb.batch_size, device=self.device)
        req = torch.repeat_interleave(batch, fb.seq_lens, output_size=total_kv)
        pos = torch.arange(total_kv, device=self.device) - kv_indptr[req]
        prefix_lens = fb.prefix_lens[req]
        in_prefix = pos < prefix_lens
        cached = fb.req_to_token_pool.req_to_token[
            fb.req_pool_indices[req], torch.where(in_prefix, pos, 0)
        ]
        new = fb.out_cache_loc[torch.where(in_prefix, 0, qo_indptr[req] + pos - prefix_lens)]
        return torch.where(in_prefix, cached, new.to(torch.int32))


def swa_table(fb: ForwardBatch, slot_map: torch.Tensor, window: int | None) -> SWATable:
    """The decode batch's last `window` keys per request (every key: None), translated into
    the SWA pool's rows by `slot_map`; columns past a request's keys hold the padding slot.
    Static shapes only, so a graph can replay it."""
    table = fb.req_to_token_pool.req_to_token
    width = table.shape[1] if window is None else min(window, table.shape[1])
    first = (fb.seq_lens - width).clamp(min=0)
    seq_lens = fb.seq_lens - first
    offsets = torch.arange(width, device=table.device)[None, :]
    columns = (first[:, None] + offsets).clamp_(max=table.shape[1] - 1)
    slots = table.index_select(0, fb.req_pool_indices).gather(1, columns).long()
    slots.masked_fill_(offsets >= seq_lens[:, None], 0)
    return SWATable(
        slot_map[slots].to(torch.int32),
        torch.arange(len(first), device=table.device),
        seq_lens,
        slot_map[fb.out_cache_loc],
    )
