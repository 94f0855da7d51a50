"""Which adapter sits in which of the worker's ``max_loras`` slots.

A sequence is admitted only when its adapter is resident or can be made so: a free slot, or the least recently used
slot whose adapter no running sequence uses (that adapter is swapped out; it is read again when next needed). The
slots a step needs are thus always resident for the whole time its sequences run. New residents are queued as
``LoRALoad``s that the step's batch description carries to every rank.
"""

from __future__ import annotations

import itertools

from ember.lora.request import LoRARequest
from ember.protocol import LoRALoad


class LoRASlots:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.resident: list[int | None] = [None] * max_loras  # slot -> adapter id
        self.last_used: list[int] = [0] * max_loras
        self.loads: list[LoRALoad] = []
        self.swaps = 0  # adapters swapped out for another
        self._clock = itertools.count(1)

    def slot_of(self, lora_id: int) -> int:
        return self.resident.index(lora_id)

    def can_take(self, lora_id: int, in_use: set[int]) -> bool:
        """The adapter is resident, or a slot is free or holds an adapter nothing running uses."""
        return lora_id in self.resident or any(r is None or r not in in_use for r in self.resident)

    def least_recent(self, in_use: set[int]) -> int:
        """The adapter, of those running sequences use, whose slot was taken least recently: the one to drain for
        a request that finds no slot (``Scheduler._admit``)."""
        slot = min((s for s, r in enumerate(self.resident) if r in in_use), key=self.last_used.__getitem__)
        return self.resident[slot]

    def take(self, lora: LoRARequest, in_use: set[int]) -> int:
        """The adapter's slot, loading it (into a free slot, else over the least recently used idle one) if it is
        not resident; ``can_take`` must hold."""
        if lora.lora_int_id in self.resident:
            slot = self.slot_of(lora.lora_int_id)
        else:
            free = [s for s, r in enumerate(self.resident) if r is None]
            slot = free[0] if free else min((s for s, r in enumerate(self.resident) if r not in in_use),
                                            key=self.last_used.__getitem__)
            if self.resident[slot] is not None:
                self.swaps += 1
            self.resident[slot] = lora.lora_int_id
            self.loads.append(LoRALoad(slot, lora.lora_path))
        self.last_used[slot] = next(self._clock)
        return slot

    def forget(self, lora_id: int) -> None:
        """Free the slot of an adapter that nothing running uses (a later request reads it again)."""
        if lora_id in self.resident:
            self.resident[self.slot_of(lora_id)] = None

    def take_loads(self) -> list[LoRALoad]:
        loads, self.loads = self.loads, []
        return loads
