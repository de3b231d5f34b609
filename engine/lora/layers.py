"""The LoRA term of one linear layer, for a batch that mixes adapters.

Every adapter slot s holds, per sub-projection k (q/k/v of qkv_proj, gate/up of
gate_up_proj, the one of o_proj/down_proj), A rows `[(s*K + k)*R, +R)` and the matching B
columns, zero-padded to R = `max_lora_rank`; B's other sub-projections' rows stay zero.
On CPU the whole batch then costs two matmuls whatever its adapters:

    y += ((x @ A^T) * w[token, slot]) @ B^T

where `w` (`LoRABatchInfo.token_weights`, [tokens, slots]) is each token's adapter scaling
in its slot's column and zeros elsewhere: no loop over tokens or slots, no device sync. On
CUDA a segment kernel (engine/kernels/triton/lora.py) multiplies each request's tokens by its
own slot only. Both read static buffers, so a decode graph captures either. Under tensor
parallelism A and B shard like their base layer: column-parallel layers hold B's rows of
this rank's outputs (A whole); row-parallel ones hold A's columns of this rank's inputs (B
whole), and their term joins the partial product before the all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels import custom_op
from engine.lora.errors import LoRAError
from engine.model.layers.linear import (
    Linear,
    MergedColumnParallelLinear,
    RowParallelLinear,
    Shard,
    linear,
    pack_weight,
)


@dataclass
class LoRABatchInfo:
    """What every LoRA layer reads about the current batch (set by `LoRAManager.prepare`).
    A segment is one request's tokens; `seg_slots` is None when no request has an adapter."""

    scalings: torch.Tensor
    """[slot ids]: the scaling of the adapter in each slot (0 for slot id 0, no adapter)."""
    seg_indptr: torch.Tensor | None = None
    """[requests + 1]: where each request's tokens start, and the end."""
    seg_slots: torch.Tensor | None = None
    """[requests]: each request's slot id."""
    max_seg_len: int = 0
    token_weights: torch.Tensor | None = None
    """[tokens, slots]: each token's scaling in its slot's column (the torch path only)."""


def _whole(size: int) -> Shard:
    return Shard(size, 0, size)


class LoRALayer:
    """Stacked A/B buffers of one base layer, and the hook its forward calls."""

    def __init__(
        self,
        base: Linear,
        num_slots: int,
        max_rank: int,
        batch: LoRABatchInfo,
    ):
        weight = base.weight
        self.input_shard = (
            base.input_shard if isinstance(base, RowParallelLinear) else _whole(base.input_size)
        )
        self.outputs: dict[str, tuple[Shard, int]] = (
            {sid: (shard, base.shard_offsets[sid]) for sid, shard in base.shards.items()}
            if isinstance(base, MergedColumnParallelLinear)
            else {"": (_whole(base.output_size), 0)}
        )
        self.num_slots, self.max_rank, self.batch = num_slots, max_rank, batch
        self.batch_invariant = base.batch_invariant
        self.slot_width = len(self.outputs) * max_rank
        width = num_slots * self.slot_width
        # in the activations' dtype: a quantized base holds uint8 blocks
        dtype = weight.dtype if weight.is_floating_point() else batch.scalings.dtype
        in_size, out_size = base.input_size, base.output_size
        self.lora_a = torch.zeros(width, in_size, dtype=dtype, device=weight.device)
        self.lora_b = torch.zeros(out_size, width, dtype=dtype, device=weight.device)
        self.repack()

    packed_a: torch.Tensor | None = None
    packed_b: torch.Tensor | None = None

    def repack(self) -> None:
        """Packed copies of A and B, where that applies (AMX or oneDNN, `pack_weight`): a plain
        bf16 `x @ A.T` on CPU pays for the layout change on every call, which made the first
        version's LoRA step slower (docs/benchmarks/lora.md). Written into the copies
        already made, so that what a graph captured stays where it was."""
        for name, weight in (("packed_a", self.lora_a), ("packed_b", self.lora_b)):
            packed, held = pack_weight(weight), getattr(self, name)
            if held is not None and packed is not None:
                held.copy_(packed)
            else:
                setattr(self, name, packed)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` plus this batch's LoRA term of input `x` (`y`, the layer's own output, is
        updated in place)."""
        batch = self.batch
        if batch.seg_slots is None:
            return y
        if custom_op.uses_triton(x):
            from engine.kernels.triton.lora import segment_lora  # imports Triton: CUDA only

            assert batch.seg_indptr is not None
            return segment_lora(
                x,
                y,
                self.lora_a,
                self.lora_b,
                self.slot_width,
                batch.seg_indptr,
                batch.seg_slots,
                batch.scalings,
                batch.max_seg_len,
            )
        assert batch.token_weights is not None
        invariant = self.batch_invariant
        xa = linear(x, self.lora_a, self.packed_a, batch_invariant=invariant)
        xa = xa.view(len(x), self.num_slots, self.slot_width)
        xa = (xa * batch.token_weights.unsqueeze(-1)).view(len(x), -1)
        return y.add_(linear(xa, self.lora_b, self.packed_b, batch_invariant=invariant))

    def slot_weights(
        self, subs: dict[str, dict[str, torch.Tensor]], rank: int, key_hint: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's padded (A `[slot_width, in]`, B `[out, slot_width]`) of one adapter,
        from its checkpoint tensors per sub-projection; a shape that does not fit the base
        layer raises LoRAError."""
        a = torch.zeros(self.slot_width, self.lora_a.shape[1], dtype=self.lora_a.dtype)
        b = torch.zeros(self.lora_b.shape[0], self.slot_width, dtype=self.lora_b.dtype)
        for k, (sid, (out_shard, offset)) in enumerate(self.outputs.items()):
            if sid not in subs:
                continue
            pair = subs[sid]
            lora_a, lora_b = pair.get("lora_A"), pair.get("lora_B")
            name = f"{key_hint}{'.' + sid if sid else ''}"
            expected_a = (rank, self.input_shard.full_size)
            expected_b = (out_shard.full_size, rank)
            if lora_a is None or lora_b is None:
                raise LoRAError(f"adapter has lora_A or lora_B missing for {name}")
            if tuple(lora_a.shape) != expected_a or tuple(lora_b.shape) != expected_b:
                raise LoRAError(
                    f"adapter shapes for {name}: A {tuple(lora_a.shape)}, B "
                    f"{tuple(lora_b.shape)}; the model needs A {expected_a}, B {expected_b}"
                )
            rows = slice(k * self.max_rank, k * self.max_rank + rank)
            inp = self.input_shard
            a[rows] = lora_a.narrow(1, inp.start, inp.size)
            b[offset : offset + out_shard.size, rows] = lora_b.narrow(
                0, out_shard.start, out_shard.size
            )
        return a, b

    def write_slot(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Copy one adapter's padded weights into buffer slot `slot` (zeros when None), and
        repack (a swap is rare: once per adapter that enters the slots)."""
        cols = slice(slot * self.slot_width, (slot + 1) * self.slot_width)
        if a is None or b is None:
            self.lora_a[cols].zero_()
            self.lora_b[:, cols].zero_()
        else:
            self.lora_a[cols].copy_(a, non_blocking=True)
            self.lora_b[:, cols].copy_(b, non_blocking=True)
        self.repack()
