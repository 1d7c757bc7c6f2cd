"""Deterministic slot allocation: the lowest free slot, so every rank picks the same one."""

from __future__ import annotations

import heapq


class SlotAllocator:
    """A min-heap of free slot indices (same events -> same slots on every TP rank)."""

    def __init__(self, max_slots: int) -> None:
        self.max_slots = max_slots
        self._free = list(range(max_slots))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        if not self._free:
            return None
        slot = heapq.heappop(self._free)
        self._used.add(slot)
        return slot

    def release(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"slot {slot} is not allocated (double release?)")
        self._used.remove(slot)
        heapq.heappush(self._free, slot)

    def in_use(self) -> frozenset[int]:
        return frozenset(self._used)
