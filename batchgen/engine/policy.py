"""Scheduling policies: the order of the waiting queue and the choice of preemption victim.

Each policy is one class behind a small interface; `POLICIES` maps the option's names
(`batchgen.config.POLICY_NAMES`) to them. The engine's scheduler orders its waiting requests with
them, and the job's look-ahead window (`batchgen.jobs.window`) the rows it has read but not yet
handed to the engine, so both follow one rule.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from batchgen.config import FCFS, MAX_THROUGHPUT, PRIORITY

if TYPE_CHECKING:
    from collections.abc import Callable


class Queued(Protocol):
    """What a policy reads of what it queues: a `batchgen.engine.request.Request` (importing it would
    import torch), or a row of the job's look-ahead window."""

    @property
    def request_id(self) -> str: ...
    @property
    def seq_no(self) -> int: ...
    @property
    def num_preemptions(self) -> int: ...
    @property
    def priority(self) -> int: ...
    @property
    def remaining_work(self) -> int: ...
    @property
    def arrival_step(self) -> int: ...


R = TypeVar("R", bound=Queued)


class Policy(Generic[R]):
    """A waiting queue plus a victim rule.

    `peek(step)` / `pop(step)` give the next request to admit at scheduler step `step`;
    `push(request)` adds a new or preempted request; `victim(candidates)` names the running request to
    preempt when blocks run out. A request is read through `request_id`, `seq_no` (arrival order),
    `num_preemptions`, `priority`, `remaining_work` and `arrival_step` only.
    """

    name = "abstract"

    def push(self, request: R) -> None:
        """Add a new or preempted request to the waiting queue."""
        raise NotImplementedError

    def peek(self, step: int) -> R | None:
        """The request to admit next at scheduler step `step`, left in the queue (None: empty)."""
        raise NotImplementedError

    def pop(self, step: int) -> R:
        """Remove and return what `peek(step)` gives; the queue must not be empty."""
        raise NotImplementedError

    def remove(self, request: R) -> bool:
        """Drop a waiting request (an abort); False when it was not queued."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def victim(self, candidates: list[R]) -> R:
        """Default: the latest admitted request (as vLLM's fcfs)."""
        return max(candidates, key=lambda r: r.seq_no)


class FCFSPolicy(Policy[R]):
    """First come, first served: arrival (job file) order; a preempted request goes back to the front."""

    name = FCFS

    def __init__(self, aging_steps: int = 0) -> None:
        self.queue: deque[R] = deque()

    def push(self, request: R) -> None:
        if request.num_preemptions and (not self.queue or request.seq_no < self.queue[0].seq_no):
            self.queue.appendleft(request)
        elif request.num_preemptions:
            # Keep arrival order among preempted requests at the front.
            index = next((i for i, r in enumerate(self.queue) if r.seq_no > request.seq_no), len(self.queue))
            self.queue.insert(index, request)
        else:
            self.queue.append(request)

    def peek(self, step: int) -> R | None:
        return self.queue[0] if self.queue else None

    def pop(self, step: int) -> R:
        return self.queue.popleft()

    def remove(self, request: R) -> bool:
        try:
            self.queue.remove(request)
            return True
        except ValueError:
            return False

    def __len__(self) -> int:
        return len(self.queue)


def _compacted(heap: list[tuple], live: dict[str, int]) -> list[tuple]:
    """`heap` without its dead entries (each entry ends with (ticket, request)), as a heap again."""
    kept = [e for e in heap if live.get(e[-1].request_id) == e[-2]]
    heapq.heapify(kept)
    return kept


class _HeapPolicy(Policy[R]):
    """A heap keyed by `key(request)` with lazy deletion (O(log n) push/pop, O(1) remove).

    Removed entries stay in the heap until they reach its top; when dead entries outnumber live
    ones the heap is rebuilt without them, so a long job's queue stays the size of what it holds.
    """

    def __init__(self, aging_steps: int = 0) -> None:
        self.heap: list[tuple] = []
        self.live: dict[str, int] = {}  # request_id -> ticket of its current heap entry
        self.tickets = itertools.count()

    def key(self, request: R) -> tuple:
        raise NotImplementedError

    def push(self, request: R) -> None:
        ticket = next(self.tickets)
        self.live[request.request_id] = ticket
        heapq.heappush(self.heap, (*self.key(request), ticket, request))
        if len(self.heap) > 2 * len(self.live) + 16:
            self.heap = _compacted(self.heap, self.live)

    def _clean(self, heap: list[tuple]) -> None:
        while heap and self.live.get(heap[0][-1].request_id) != heap[0][-2]:
            heapq.heappop(heap)

    def peek(self, step: int) -> R | None:
        self._clean(self.heap)
        return self.heap[0][-1] if self.heap else None

    def pop(self, step: int) -> R:
        request = self.peek(step)
        assert request is not None, "pop() on an empty queue"  # internal invariant, not user input
        del self.live[request.request_id]
        return request

    def remove(self, request: R) -> bool:
        return self.live.pop(request.request_id, None) is not None

    def __len__(self) -> int:
        return len(self.live)


class PriorityPolicy(_HeapPolicy[R]):
    """Lower `priority` value first (vLLM's convention), then arrival order; victim: the lowest priority."""

    name = PRIORITY

    def key(self, request: R) -> tuple:
        return (request.priority, request.seq_no)

    def victim(self, candidates: list[R]) -> R:
        return max(candidates, key=lambda r: (r.priority, r.seq_no))


class MaxThroughputPolicy(_HeapPolicy[R]):
    """Least remaining work first (shortest-job-first), with aging against starvation.

    Remaining work is the request's uncomputed tokens plus its outstanding output budget
    (`max_tokens`). Serving short work first lowers mean latency and frees KV blocks sooner. A request
    that has waited more than `aging_steps` scheduler steps is served next, oldest first, so no request
    waits more than `aging_steps` steps plus the time for a running request to make room.
    Victim: the running request with the most remaining work (it would hold its blocks the longest).
    """

    name = MAX_THROUGHPUT

    def __init__(self, aging_steps: int = 256) -> None:
        super().__init__()
        self.aging_steps = aging_steps
        self.by_age: list[tuple] = []

    def key(self, request: R) -> tuple:
        return (request.remaining_work, request.seq_no)

    def push(self, request: R) -> None:
        super().push(request)
        heapq.heappush(
            self.by_age, (request.arrival_step, request.seq_no, self.live[request.request_id], request)
        )
        if len(self.by_age) > 2 * len(self.live) + 16:
            self.by_age = _compacted(self.by_age, self.live)

    def peek(self, step: int) -> R | None:
        self._clean(self.by_age)
        if self.by_age and step - self.by_age[0][-1].arrival_step > self.aging_steps:
            return self.by_age[0][-1]
        return super().peek(step)

    def victim(self, candidates: list[R]) -> R:
        return max(candidates, key=lambda r: (r.remaining_work, r.seq_no))


# One entry per name of `batchgen.config.POLICY_NAMES` (a test holds the two together).
# Any: each class queues whatever meets `Queued` (requests, the window's rows).
POLICIES: dict[str, Callable[[int], Policy[Any]]] = {
    cls.name: cls for cls in (FCFSPolicy, MaxThroughputPolicy, PriorityPolicy)
}


def make_policy(name: str, aging_steps: int) -> Policy[R]:
    """The policy named `name` (one of `batchgen.config.POLICY_NAMES`). Under max-throughput a
    request that has waited more than `aging_steps` steps (the `step` given to `peek` / `pop`) is
    served next; the other policies ignore it.

    Raises:
        ValueError: for an unknown name.
    """
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {name!r}")
    return POLICIES[name](aging_steps)
