"""Scheduling policies: the order of the waiting queue and the choice of preemption victim.

Each policy is one class behind a small interface; `POLICIES` maps the option's names to them.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from batchgen.engine.request import Request


class Policy:
    """A waiting queue plus a victim rule.

    `peek(step)` / `pop(step)` give the next request to admit at scheduler step `step`;
    `push(request)` adds a new or preempted request; `victim(candidates)` names the running request to
    preempt when blocks run out.
    """

    name = "abstract"

    def push(self, request: Request) -> None:
        """Add a new or preempted request to the waiting queue."""
        raise NotImplementedError

    def peek(self, step: int) -> Request | None:
        """The request to admit next at scheduler step `step`, left in the queue (None: empty)."""
        raise NotImplementedError

    def pop(self, step: int) -> Request:
        """Remove and return what `peek(step)` gives; the queue must not be empty."""
        raise NotImplementedError

    def remove(self, request: Request) -> bool:
        """Drop a waiting request (an abort); False when it was not queued."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def victim(self, candidates: list[Request]) -> Request:
        """Default: the latest admitted request (as vLLM's fcfs)."""
        return max(candidates, key=lambda r: r.seq_no)


class FCFSPolicy(Policy):
    """First come, first served: arrival (job file) order; a preempted request goes back to the front."""

    name = "fcfs"

    def __init__(self, aging_steps: int = 0) -> None:
        self.queue: deque[Request] = deque()

    def push(self, request: Request) -> None:
        if request.num_preemptions and (not self.queue or request.seq_no < self.queue[0].seq_no):
            self.queue.appendleft(request)
        elif request.num_preemptions:
            # Keep arrival order among preempted requests at the front.
            index = next((i for i, r in enumerate(self.queue) if r.seq_no > request.seq_no), len(self.queue))
            self.queue.insert(index, request)
        else:
            self.queue.append(request)

    def peek(self, step: int) -> Request | None:
        return self.queue[0] if self.queue else None

    def pop(self, step: int) -> Request:
        return self.queue.popleft()

    def remove(self, request: Request) -> bool:
        try:
            self.queue.remove(request)
            return True
        except ValueError:
            return False

    def __len__(self) -> int:
        return len(self.queue)


class _HeapPolicy(Policy):
    """A heap keyed by `key(request)` with lazy deletion (O(log n) push/pop, O(1) remove)."""

    def __init__(self, aging_steps: int = 0) -> None:
        self.heap: list[tuple] = []
        self.live: dict[str, int] = {}  # request_id -> ticket of its current heap entry
        self.tickets = itertools.count()

    def key(self, request: Request) -> tuple:
        raise NotImplementedError

    def push(self, request: Request) -> None:
        ticket = next(self.tickets)
        self.live[request.request_id] = ticket
        heapq.heappush(self.heap, (*self.key(request), ticket, request))

    def _clean(self, heap: list[tuple]) -> None:
        while heap and self.live.get(heap[0][-1].request_id) != heap[0][-2]:
            heapq.heappop(heap)

    def peek(self, step: int) -> Request | None:
        self._clean(self.heap)
        return self.heap[0][-1] if self.heap else None

    def pop(self, step: int) -> Request:
        request = self.peek(step)
        assert request is not None, "pop() on an empty queue"  # internal invariant, not user input
        del self.live[request.request_id]
        return request

    def remove(self, request: Request) -> bool:
        return self.live.pop(request.request_id, None) is not None

    def __len__(self) -> int:
        return len(self.live)


class PriorityPolicy(_HeapPolicy):
    """Lower `priority` value first (vLLM's convention), then arrival order; victim: the lowest priority."""

    name = "priority"

    def key(self, request: Request) -> tuple:
        return (request.priority, request.seq_no)

    def victim(self, candidates: list[Request]) -> Request:
        return max(candidates, key=lambda r: (r.priority, r.seq_no))


class MaxThroughputPolicy(_HeapPolicy):
    """Least remaining work first (shortest-job-first), with aging against starvation.

    Remaining work is the request's uncomputed tokens plus its outstanding output budget
    (`max_tokens`). Serving short work first lowers mean latency and frees KV blocks sooner. A request
    that has waited more than `aging_steps` scheduler steps is served next, oldest first, so no request
    waits more than `aging_steps` steps plus the time for a running request to make room.
    Victim: the running request with the most remaining work (it would hold its blocks the longest).
    """

    name = "max-throughput"

    def __init__(self, aging_steps: int = 256) -> None:
        super().__init__()
        self.aging_steps = aging_steps
        self.by_age: list[tuple] = []

    def key(self, request: Request) -> tuple:
        return (request.remaining_work, request.seq_no)

    def push(self, request: Request) -> None:
        super().push(request)
        heapq.heappush(
            self.by_age, (request.arrival_step, request.seq_no, self.live[request.request_id], request)
        )

    def peek(self, step: int) -> Request | None:
        self._clean(self.by_age)
        if self.by_age and step - self.by_age[0][-1].arrival_step > self.aging_steps:
            return self.by_age[0][-1]
        return super().peek(step)

    def victim(self, candidates: list[Request]) -> Request:
        return max(candidates, key=lambda r: (r.remaining_work, r.seq_no))


POLICIES: dict[str, type[Policy]] = {
    "fcfs": FCFSPolicy,
    "max-throughput": MaxThroughputPolicy,
    "priority": PriorityPolicy,
}


def make_policy(name: str, aging_steps: int) -> Policy:
    """The policy named `name` ("fcfs", "max-throughput" or "priority").

    Raises:
        ValueError: for an unknown name.
    """
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {name!r}")
    return POLICIES[name](aging_steps)
