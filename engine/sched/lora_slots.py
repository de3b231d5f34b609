"""The scheduler's side of multi-LoRA: which adapters are loaded (at start, or at run time
under `--enable-lora-runtime-update` from under `--lora-root`), whether a request's
adapter can join a batch (the slots of a batch are finite), and each batch row's slot."""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from engine.args import EngineArgs
from engine.cache.base_prefix_cache import BasePrefixCache
from engine.cache.namespace import PrefixNamespace
from engine.lora import LoRAError, LoRAManager
from engine.sched.batch import ScheduleBatch
from engine.sched.req import Req


class LoRASlots:
    def __init__(self, manager: LoRAManager | None, args: EngineArgs, device: torch.device):
        self.manager = manager
        self.runtime_update = args.enable_lora_runtime_update
        self.roots = [os.path.realpath(root) for root in args.lora_roots()]
        self.device = device
        for name, path in args.lora_entries().items():
            self._manager().load(name, path)

    def check_request(self, req: Req) -> None:
        """Raise LoRAError (404) unless `req`'s adapter, if it names one, is loaded."""
        name = req.admission.lora_name
        if name is not None and (self.manager is None or name not in self.manager.adapters):
            raise LoRAError(f"no LoRA adapter named {name!r} is loaded", 404, "model")

    def load(self, name: str, path: str) -> None:
        """Load an adapter at run time (only under --enable-lora-runtime-update, from under
        --lora-root); raises LoRAError, leaving what serves untouched."""
        manager = self._manager()
        self._check_runtime_update("loading")
        real = os.path.realpath(path)
        if not any(os.path.commonpath([real, root]) == root for root in self.roots):
            raise LoRAError(f"lora_path {path!r} is not under --lora-root {self.roots}")
        manager.load(name, path)

    def check_unload(self, name: str, live: Iterable[Req]) -> None:
        """Raise LoRAError unless `name` can be unloaded now: 404 when it is not loaded, 409
        while a request of `live` (every unfinished one) uses it."""
        manager = self._manager()
        self._check_runtime_update("unloading")
        if name not in manager.adapters:
            raise LoRAError(f"no LoRA adapter named {name!r} is loaded", 404, "lora_name")
        if any(req.admission.lora_name == name for req in live):
            raise LoRAError(f"LoRA adapter {name!r} has requests in flight", 409, "lora_name")

    def unload(self, name: str, tree_cache: BasePrefixCache) -> None:
        """Unload `name` (after `check_unload`, with no batch of it in flight) and free its
        cached prefixes."""
        tree_cache.evict_namespace(PrefixNamespace(lora=name))
        self._manager().unload(name)

    def adapters(self) -> dict[str, str]:
        """Loaded adapters: name -> path."""
        if self.manager is None:
            return {}
        return {name: adapter.path for name, adapter in self.manager.adapters.items()}

    def info(self, running: Iterable[Req], waiting: Iterable[Req]) -> tuple[list[str], list[str]]:
        """(adapters of `running` requests, adapters of `waiting` ones), for the metrics."""
        return sorted(_names(running)), sorted(_names(waiting))

    def held(self, reqs: Iterable[Req]) -> set[str]:
        """Adapters the next batch holds slots for already: those of `reqs`, the running
        and chunked requests."""
        if self.manager is None:
            return set()
        return _names(reqs)

    def fits(self, req: Req, held: set[str]) -> bool:
        """Whether `req` can join a batch already naming `held` adapters."""
        name = req.admission.lora_name
        if name is None or name in held or self.manager is None:
            return True
        return len(held) < self.manager.num_slots

    def needs_swap(self, reqs: Iterable[Req]) -> bool:
        """A batch of `reqs` loads an adapter into a slot (which a batch in flight may read)."""
        if self.manager is None:
            return False
        return self.manager.needs_swap([r.admission.lora_name for r in reqs])

    def assign(self, batch: ScheduleBatch) -> None:
        """Give the batch's rows their adapters' slots, where adapters are on."""
        if self.manager is not None:
            batch.forward_batch.lora_slots = self.slot_ids(batch)

    def slot_ids(self, batch: ScheduleBatch) -> torch.Tensor | None:
        """Each request's adapter slot id, or None when no request of the batch has one."""
        if self.manager is None:
            return None
        names = [r.admission.lora_name for r in batch.reqs]
        if not any(names):
            return None
        slots = torch.tensor(self.manager.acquire(names), dtype=torch.int64)
        return slots.to(self.device, non_blocking=True)

    def _manager(self) -> LoRAManager:
        if self.manager is None:
            raise LoRAError(
                "LoRA is off: start with --lora-paths or --enable-lora-runtime-update",
                param="lora_name",
            )
        return self.manager

    def _check_runtime_update(self, doing: str) -> None:
        if not self.runtime_update:
            raise LoRAError(
                f"{doing} adapters at run time needs --enable-lora-runtime-update",
                param="lora_name",
            )


def _names(reqs: Iterable[Req]) -> set[str]:
    """The adapters `reqs` run under."""
    return {r.admission.lora_name for r in reqs if r.admission.lora_name is not None}
