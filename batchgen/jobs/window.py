"""Look-ahead window: the bounded set of read-but-not-admitted rows, popped in policy order.

The engine orders what it already holds; the window decides what it gets next, so a job file of
millions of rows is never in memory and `max-throughput` can still pick short rows first.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Generic, TypeVar

from batchgen.config import POLICIES

T = TypeVar("T")


class LookaheadWindow(Generic[T]):
    """Holds at most `capacity` items and pops them in `policy` order.

    - "fcfs": input order.
    - "max-throughput": least total work first (prompt tokens + max_tokens), ties in input order;
      an item passed over by `capacity` pops is served next (aging), so a long row waits at most
      about two windows and the output stays close to input order.
    - "priority": lowest `priority` value first (as vLLM), then input order.

    Args:
        policy: one of `batchgen.config.POLICIES`.
        capacity: most items held (rows); >= 1.

    Raises:
        ValueError: unknown policy or capacity < 1.
    """

    def __init__(self, policy: str, capacity: int) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        if capacity < 1:
            raise ValueError(f"window capacity must be >= 1 row, got {capacity}")
        self.policy = policy
        self.capacity = capacity
        self._seq = 0
        self._pops = 0
        self._size = 0
        self._fifo: deque[list] = deque()  # entries in input order: [key, seq, pushed_at_pop, item, alive]
        self._heap: list[list] = []

    def __len__(self) -> int:
        return self._size

    @property
    def full(self) -> bool:
        """True when the window holds `capacity` items."""
        return self._size >= self.capacity

    def push(self, item: T, work: int = 0, priority: int = 0) -> None:
        """Add an item; `work` is its total tokens, `priority` its priority value (lower first)."""
        key = work if self.policy == "max-throughput" else priority if self.policy == "priority" else 0
        entry = [key, self._seq, self._pops, item, True]
        self._seq += 1
        self._size += 1
        if self.policy != "priority":  # priority has no aging, so it needs no input-order queue
            self._fifo.append(entry)
        if self.policy != "fcfs":
            heapq.heappush(self._heap, entry)
            if len(self._heap) > 2 * self.capacity:  # aged pops leave dead heap entries behind
                self._heap = [e for e in self._heap if e[4]]
                heapq.heapify(self._heap)

    def pop(self) -> T:
        """Remove and return the next item by policy.

        Raises:
            IndexError: the window is empty.
        """
        if not self._size:
            raise IndexError("pop from an empty window")
        aged = False
        if self.policy == "max-throughput":
            while not self._fifo[0][4]:
                self._fifo.popleft()
            aged = self._pops - self._fifo[0][2] >= self.capacity
        if self.policy == "fcfs" or aged:
            entry = self._fifo.popleft()
        else:
            entry = heapq.heappop(self._heap)
            while not entry[4]:
                entry = heapq.heappop(self._heap)
        entry[4] = False
        self._pops += 1
        self._size -= 1
        item = entry[3]
        entry[3] = None
        if not self._size:  # drop dead entries so they do not pile up
            self._fifo.clear()
            self._heap.clear()
        return item
