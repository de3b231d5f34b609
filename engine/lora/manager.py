"""The adapters an engine holds, and which of them sit in the `max_loras_per_batch` slots
of the stacked buffers (least recently used ones leave first)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import custom_op
from engine.lora.adapter import LoRAAdapter, load_adapter
from engine.lora.errors import LoRAError
from engine.lora.layers import LoRABatchInfo, LoRALayer
from engine.model.forward_batch import ForwardBatch
from engine.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear

NO_ADAPTER = 0
"""The slot id of a token without an adapter; adapter slots are 1..max_loras_per_batch."""


class LoRAManager:
    """Attaches a `LoRALayer` to every qkv/o/gate_up/down layer of `model`, loads adapters
    to the host and swaps them into slots on demand. The scheduler makes sure a batch never
    names more adapters than there are slots."""

    def __init__(self, model: nn.Module, max_loras_per_batch: int, max_lora_rank: int):
        if max_loras_per_batch < 1 or max_lora_rank < 1:
            raise ValueError("max_loras_per_batch and max_lora_rank must be >= 1")
        self.num_slots, self.max_rank = max_loras_per_batch, max_lora_rank
        # the model's dtype: quantized layers hold uint8 blocks, its norms the dtype
        weight = next(p for p in model.parameters() if p.is_floating_point())
        self.batch = LoRABatchInfo(
            scalings=torch.zeros(max_loras_per_batch + 1, dtype=weight.dtype, device=weight.device)
        )
        self.model = model
        self.layers: dict[str, LoRALayer] = {}
        for name, module in model.named_modules():
            if isinstance(module, MergedColumnParallelLinear | RowParallelLinear):
                module.lora = self.layers[name] = LoRALayer(
                    module, max_loras_per_batch, max_lora_rank, self.batch
                )
        self.slot_scalings = torch.zeros(
            max_loras_per_batch + 1, max_loras_per_batch, dtype=weight.dtype, device=weight.device
        )
        """Row `slot id` is a token's `token_weights` row: its scaling in its slot's column."""
        self.adapters: dict[str, LoRAAdapter] = {}
        self.resident: OrderedDict[str, int] = OrderedDict()
        """Adapter name -> buffer slot, least recently used first."""
        self.free_slots = list(range(max_loras_per_batch - 1, -1, -1))

    def load(self, name: str, path: str) -> None:
        if name in self.adapters:
            raise LoRAError(f"an adapter named {name!r} is already loaded", param="lora_name")
        self.adapters[name] = load_adapter(name, path, self.model, self.layers, self.max_rank)

    def unload(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise LoRAError(f"no adapter named {name!r} is loaded", 404, "lora_name")
        slot = self.resident.pop(name, None)
        if slot is not None:
            self._set_scaling(slot, 0.0)
            self.free_slots.append(slot)

    def needs_swap(self, names: Sequence[str | None]) -> bool:
        """Whether serving `names` writes some slot (the in-flight batch must finish first)."""
        return any(name is not None and name not in self.resident for name in names)

    def acquire(self, names: Sequence[str | None]) -> list[int]:
        """The slot id of each request's adapter (0 for none), swapping in those not
        resident over the least recently used ones the batch does not name."""
        wanted = dict.fromkeys(name for name in names if name is not None)
        if len(wanted) > self.num_slots:
            raise RuntimeError(
                f"a batch names {len(wanted)} adapters; there are {self.num_slots} slots"
            )
        for name in wanted:
            if name in self.resident:
                self.resident.move_to_end(name)
            else:
                self._swap_in(name, wanted)
        return [NO_ADAPTER if name is None else self.resident[name] + 1 for name in names]

    def _swap_in(self, name: str, keep: dict[str, None]) -> None:
        if not self.free_slots:
            victim = next(n for n in self.resident if n not in keep)
            self.free_slots.append(self.resident.pop(victim))
        slot = self.free_slots.pop()
        adapter = self.adapters[name]
        for layer_name, layer in self.layers.items():
            a, b = adapter.weights.get(layer_name, (None, None))
            layer.write_slot(slot, a, b)
        self._set_scaling(slot, adapter.scaling)
        self.resident[name] = slot

    def _set_scaling(self, slot: int, scaling: float) -> None:
        """In place: the decode graphs read these buffers where they were captured."""
        self.slot_scalings[slot + 1, slot] = scaling
        self.batch.scalings[slot + 1] = scaling

    def prepare(self, forward_batch: ForwardBatch) -> None:
        """Point every LoRA layer at this batch's adapters, from its per-request slot ids:
        tensor ops on the device only, so that a decode graph runs this too."""
        batch, slots = self.batch, forward_batch.lora_slots
        batch.seg_slots = slots
        batch.seg_indptr = batch.token_weights = None
        if slots is None:
            return
        lens = forward_batch.extend_lens
        if custom_op.uses_triton(slots):
            batch.seg_indptr = F.pad(torch.cumsum(lens, 0), (1, 0))
            batch.max_seg_len = max(forward_batch.extend_lens_cpu)
            return
        token_slots = slots
        if not forward_batch.forward_mode.is_decode():
            num_tokens = len(forward_batch.input_ids)
            token_slots = torch.repeat_interleave(slots, lens, output_size=num_tokens)
        batch.token_weights = self.slot_scalings[token_slots]
