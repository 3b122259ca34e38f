"""`batchgen plan`'s prefix-cache estimate: the engine's BlockManager, its hits and its LRU."""

from __future__ import annotations

from batchgen.plan.prefix import PrefixEstimate


def test_prefix_estimate_counts_shared_full_blocks_within_the_cache():
    est = PrefixEstimate(block_size=4, capacity=100)
    assert est.add(list(range(9)))[0] == 0  # blocks [0-3], [4-7]: nothing cached yet
    hits, hashes = est.add(list(range(8)) + [99])  # both blocks hit
    assert hits == 8 and len(hashes) == 2 and hashes == est.add(list(range(8)) + [5])[1]
    assert est.add([7, 7, 7, 7, 1])[0] == 0  # another first block: no hit
    assert est.add(list(range(6)))[0] == 4  # first block hits; [4, 5] is not full
    assert est.hit_tokens == 8 + 8 + 4
    # A row asking for prompt log probabilities takes no hit, as in the engine; its blocks are
    # computed anew, and its third ([8-11]) is not cached: its parent's hash is held by another
    # physical block (the block manager registers a block only under its own parent).
    assert est.add(list(range(12)) + [1], served=False)[0] == 0 and est.hit_tokens == 8 + 8 + 4
    assert est.add(list(range(12)) + [2])[0] == 8
    # The engine's LRU: a freed prompt's uncached tail block is handed out first, then its full
    # blocks, last first. With 2 blocks the second prompt takes both (the first's block evicted);
    # with 3 it takes the tail and the spare one, and the first's block stays.
    for capacity, hit in ((2, 0), (3, 4)):
        est = PrefixEstimate(block_size=4, capacity=capacity)
        est.add([1, 2, 3, 4, 0])
        est.add([5, 6, 7, 8, 0])
        assert est.add([1, 2, 3, 4, 0])[0] == hit, capacity
