import random
from collections import OrderedDict

import pytest

from batchgen.plan.block_lru import BlockLru


class ReferenceLru:
    def __init__(self, capacity: int) -> None:
        self.capacity, self.keys = capacity, OrderedDict()

    def touch(self, key: int) -> bool:
        if key in self.keys:
            self.keys.move_to_end(key)
            return True
        if len(self.keys) >= self.capacity:
            self.keys.popitem(last=False)
        self.keys[key] = None
        return False


@pytest.mark.parametrize("capacity", [1, 3, 700, 5000, 100_000])
def test_block_lru_answers_as_an_ordered_dict_lru_does(capacity):
    rng = random.Random(capacity)
    lru, ref = BlockLru(capacity), ReferenceLru(capacity)
    # Hot keys (hit often), a growing stream of cold ones, and negative / 64-bit keys as hash() gives.
    for step in range(60_000):
        r = rng.random()
        if r < 0.4:
            key = rng.randrange(50)
        elif r < 0.5:
            key = -rng.randrange(1, 1 << 63)
        else:
            key = rng.randrange(1 << 64) if r > 0.9 else step * 7919
        assert lru.touch(key) == ref.touch(key % (1 << 64)), step
    assert len(lru) == len(ref.keys) <= capacity


def test_block_lru_keeps_a_key_it_just_used_over_older_ones():
    lru = BlockLru(2)
    lru.touch(1), lru.touch(2), lru.touch(1), lru.touch(3)  # 2 is the least recently used
    assert lru.touch(1) and not lru.touch(2)
