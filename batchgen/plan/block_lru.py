"""A least-recently-used set of 64-bit block hashes in flat arrays, for `batchgen plan`'s estimate of
the prefix cache over a whole job file.

A Python `OrderedDict` costs about 160 bytes a block (its node, the dict slot and the int key), which
on a 200,000-row file was a tenth of plan's memory. Here a block costs about 17 bytes a slot (an
open-addressing table with linear probing: the key, its last use, a state byte, at most 60% full),
and the eviction order (a queue of (key, use) pairs, stale ones skipped) is built only once the set
is full: with a KV cache larger than the job's blocks, as on small models, it never is.
"""

from __future__ import annotations

from array import array

import numpy as np

_EMPTY, _LIVE, _GONE = 0, 1, 2
_MASK64 = (1 << 64) - 1


class BlockLru:
    """An exact LRU set of at most `capacity` keys (any int; kept modulo 2**64).

    `touch(key)` reports whether the key was held and makes it the most recently used, inserting it
    (and evicting the least recently used key when full) if it was not.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = max(int(capacity), 1)
        self.live = 0
        self._clock = 0
        self._alloc(1024)
        self._queue: tuple[array, array] | None = None  # (keys, uses) in use order, from _head on
        self._head = 0

    def __len__(self) -> int:
        return self.live

    def touch(self, key: int) -> bool:
        key &= _MASK64
        self._clock += 1
        slot = self._find(key)
        hit = slot >= 0
        if not hit:
            if self.live >= self.capacity:
                self._evict_oldest()
            slot = self._insert(key)
        self._uses[slot] = self._clock
        if self._queue is not None:
            self._queue[0].append(key)
            self._queue[1].append(self._clock)
            if len(self._queue[0]) - self._head > 4 * self.live + 4096:  # mostly stale: start afresh
                self._rebuild_queue()
        return hit

    def _alloc(self, size: int) -> None:
        self._keys = array("Q", bytes(8 * size))
        self._uses = array("q", bytes(8 * size))
        self._state = bytearray(size)
        self._used = 0  # live and gone slots: a probe stops only at an empty one

    def _find(self, key: int) -> int:
        mask = len(self._state) - 1
        i = key & mask
        while (s := self._state[i]) != _EMPTY:
            if s == _LIVE and self._keys[i] == key:
                return i
            i = (i + 1) & mask
        return -1

    def _insert(self, key: int) -> int:
        if (self._used + 1) * 5 > len(self._state) * 3:
            self._rehash()
        mask = len(self._state) - 1
        i = key & mask
        while self._state[i] == _LIVE:
            i = (i + 1) & mask
        self._used += self._state[i] == _EMPTY
        self._state[i], self._keys[i] = _LIVE, key
        self.live += 1
        return i

    def _live(self) -> tuple[np.ndarray, np.ndarray]:
        """The live keys and their uses (numpy: no Python object per key)."""
        live = np.frombuffer(self._state, np.uint8) == _LIVE
        return np.frombuffer(self._keys, np.uint64)[live], np.frombuffer(self._uses, np.int64)[live]

    def _rehash(self) -> None:
        """Into a table twice the live keys' need (gone slots dropped); uses are kept."""
        keys, uses = self._live()
        size = 1024
        while size * 3 < (len(keys) + 1) * 10:
            size *= 2
        self._alloc(size)
        self.live = 0
        for j in range(len(keys)):
            self._uses[self._insert(int(keys[j]))] = int(uses[j])

    def _evict_oldest(self) -> None:
        if self._queue is None or self._head > 2 * self.live + 1024:
            self._rebuild_queue()
        keys, uses = self._queue
        while True:
            key, use = keys[self._head], uses[self._head]
            self._head += 1
            slot = self._find(key)
            if slot >= 0 and self._uses[slot] == use:  # else used again since: a stale entry
                self._state[slot] = _GONE
                self.live -= 1
                return

    def _rebuild_queue(self) -> None:
        keys, uses = self._live()
        order = np.argsort(uses, kind="stable")
        self._queue = (array("Q", keys[order].tobytes()), array("q", uses[order].tobytes()))
        self._head = 0
