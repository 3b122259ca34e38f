"""Look-ahead window: the bounded set of read-but-not-admitted rows, popped in policy order.

The engine orders what it already holds; the window decides what it gets next, so a job file of
millions of rows is never in memory and `max-throughput` can still pick short rows first. The
order is the engine's own (`batchgen.engine.policy`): each row stands in the policy's queue as a
request would, with the window's pops as the policy's steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from batchgen.engine.policy import Policy, make_policy

T = TypeVar("T")


@dataclass(slots=True, eq=False)
class _Entry:
    """A row in the policy's queue: what the policies read of a request, and the row itself."""

    request_id: str  # the push number: the heap policies key their bookkeeping by it
    seq_no: int  # input order, the tie-breaker
    arrival_step: int  # pops before this push: the aging clock
    remaining_work: int
    priority: int
    item: Any
    num_preemptions: int = 0  # a window row is never preempted


class LookaheadWindow(Generic[T]):
    """Holds at most `capacity` items and pops them in `policy` order.

    - "fcfs": input order.
    - "max-throughput": least total work first (prompt tokens + max_tokens), ties in input order;
      an item passed over by `capacity` pops is served next (the policy's aging, with
      `aging_steps = capacity - 1`), so a long row waits at most about two windows and the output
      stays close to input order.
    - "priority": lowest `priority` value first (as vLLM), then input order.

    Args:
        policy: one of `batchgen.config.POLICY_NAMES`.
        capacity: most items held (rows); >= 1.

    Raises:
        ValueError: unknown policy or capacity < 1.
    """

    def __init__(self, policy: str, capacity: int) -> None:
        self._queue: Policy[_Entry] = make_policy(policy, aging_steps=capacity - 1)
        if capacity < 1:
            raise ValueError(f"window capacity must be >= 1 row, got {capacity}")
        self.policy = policy
        self.capacity = capacity
        self._pushes = 0
        self._pops = 0

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def full(self) -> bool:
        """True when the window holds `capacity` items."""
        return len(self._queue) >= self.capacity

    def push(self, item: T, work: int = 0, priority: int = 0) -> None:
        """Add an item; `work` is its total tokens, `priority` its priority value (lower first)."""
        n = self._pushes
        self._queue.push(_Entry(str(n), n, self._pops, work, priority, item))
        self._pushes += 1

    def pop(self) -> T:
        """Remove and return the next item by policy.

        Raises:
            IndexError: the window is empty.
        """
        if not len(self._queue):
            raise IndexError("pop from an empty window")
        entry = self._queue.pop(self._pops)
        self._pops += 1
        item, entry.item = entry.item, None  # a dead heap entry must not keep its row alive
        return item
