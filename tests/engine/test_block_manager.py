"""BlockManager: exact block counts through allocate, share, free, hit, evict and swap sequences;
prefix-cache hits are never another prompt's blocks, even under forced hash collisions."""

from __future__ import annotations

import random

import pytest

from batchgen.engine.block_manager import BlockManager, default_block_hash
from batchgen.engine.request import Request
from batchgen.sampling_params import SamplingParams

BS = 4  # tokens per block in these tests


def make_request(token_ids: list[int], request_id: str = "r", max_tokens: int = 8) -> Request:
    return Request(request_id, list(token_ids), SamplingParams(), arrival_time=0.0, max_tokens=max_tokens)


def admit(bm: BlockManager, request: Request) -> list[int]:
    """Admit a request holding no blocks as the scheduler does: take its cached prefix, allocate the
    rest of its tokens, and mark them computed (as the scheduler's update would). Returns the hits."""
    hits = bm.find_cached_prefix(request)
    remaining = request.num_tokens - len(hits) * bm.block_size
    hit = bm.allocate_slots(request, remaining, hits)
    assert hit == len(hits) * bm.block_size
    if hit:
        request.num_cached_tokens = hit
    request.num_computed_tokens = request.num_tokens
    bm.cache_full_blocks(request)
    return hits


def counts(bm: BlockManager) -> tuple[int, int, int]:
    return bm.num_free_blocks, bm.num_cached_blocks, bm.num_used_blocks


def check_consistent(bm: BlockManager, live: list[Request]) -> None:
    """Ref counts equal the number of live block tables holding each block; the free pool is exactly
    the unreferenced blocks; every cached hash points at a block that carries it."""
    refs = [0] * bm.num_blocks
    for r in live:
        for b in r.block_table:
            refs[b] += 1
    assert [b.ref_count for b in bm.blocks] == refs
    assert set(bm.free_queue) == {i for i, n in enumerate(refs) if n == 0}
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    for block_hash, block_id in bm.cached.items():
        assert bm.blocks[block_id].block_hash == block_hash


def test_allocate_counts_and_free() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    assert counts(bm) == (8, 0, 0)
    r = make_request(list(range(100, 110)))  # 10 tokens: 2 full blocks + 2 tokens
    assert bm.allocate_slots(r, 6) == 0  # a first chunk of 6 tokens: 2 blocks
    assert counts(bm) == (6, 0, 2)
    r.num_computed_tokens = 6
    bm.cache_full_blocks(r)
    assert counts(bm) == (6, 1, 2)  # only the first block is full of computed tokens
    assert bm.allocate_slots(r, 4) == 0  # the rest: 10 tokens need 3 blocks, 1 more
    assert len(r.block_table) == 3
    r.num_computed_tokens = 10
    bm.cache_full_blocks(r)
    assert counts(bm) == (5, 2, 3)
    assert len(r.block_hashes) == 2
    # A request that does not fit changes nothing.
    big = make_request(list(range(200, 224)))  # 24 tokens = 6 blocks > 5 free
    assert bm.allocate_slots(big, 24) is None
    assert counts(bm) == (5, 2, 3) and big.block_table == []
    check_consistent(bm, [r])
    bm.free(r)
    assert r.block_table == [] and r.block_hashes == []
    assert counts(bm) == (8, 2, 0)  # freed blocks keep their content for later hits
    check_consistent(bm, [])


def test_share_common_prefix() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    prefix = list(range(10, 18))  # two full blocks
    a = make_request(prefix + [1, 2], "a")
    b = make_request(prefix + [3, 4, 5], "b")
    assert admit(bm, a) == []
    assert counts(bm) == (5, 2, 3)
    hits = admit(bm, b)
    assert hits == a.block_table[:2]
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_count for i in hits] == [2, 2]
    assert b.num_cached_tokens == 8
    assert b.block_hashes[:2] == a.block_hashes
    assert counts(bm) == (4, 2, 4)  # b took one new block only
    check_consistent(bm, [a, b])
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in hits] == [1, 1]
    assert counts(bm) == (5, 2, 3)
    check_consistent(bm, [b])
    bm.free(b)
    assert counts(bm) == (8, 2, 0)
    check_consistent(bm, [])


def test_hit_revives_freed_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = list(range(30, 42))  # 12 tokens = 3 full blocks
    a = make_request(prompt, "a")
    admit(bm, a)
    old = list(a.block_table)
    bm.free(a)
    assert counts(bm) == (8, 3, 0)
    c = make_request(prompt + [7], "c")  # same prefix, one more token
    hits = admit(bm, c)
    assert hits == old  # all three blocks come back from the LRU pool
    assert c.block_table[:3] == old and c.block_table[3] not in old
    assert all(bm.blocks[i].ref_count == 1 for i in c.block_table)
    assert c.num_cached_tokens == 12 and c.num_computed_tokens == 13
    assert counts(bm) == (4, 3, 4)
    check_consistent(bm, [c])


def test_revived_blocks_count_against_the_free_pool() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    prompt = list(range(30, 42))  # 3 full blocks
    a = make_request(prompt, "a")
    admit(bm, a)
    bm.free(a)
    assert counts(bm) == (4, 3, 0)
    # 3 cached blocks + 2 new ones: the 4 free blocks include the 3 being revived, so it cannot fit.
    longer = make_request(prompt + [1, 2, 3, 4, 5], "longer")
    hits = bm.find_cached_prefix(longer)
    assert len(hits) == 3
    assert bm.allocate_slots(longer, 5, hits) is None
    assert counts(bm) == (4, 3, 0) and longer.block_table == [] and longer.num_computed_tokens == 0
    fits = make_request(prompt + [1, 2, 3], "fits")  # 3 cached + 1 new block
    assert bm.allocate_slots(fits, 3, bm.find_cached_prefix(fits)) == 3 * BS
    assert counts(bm) == (0, 3, 4)


def test_last_token_never_served_from_cache() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = list(range(50, 58))  # exactly two full blocks
    a = make_request(prompt, "a")
    admit(bm, a)
    a_blocks = list(a.block_table)
    assert bm.num_cached_blocks == 2
    bm.free(a)
    again = make_request(prompt, "again")
    hits = bm.find_cached_prefix(again)
    # The second block holds the last token, whose logits are needed: it is computed again.
    assert hits == a_blocks[:1]
    hit = bm.allocate_slots(again, again.num_tokens - len(hits) * BS, hits)
    assert hit == BS and again.num_tokens - hit == BS
    for n in range(1, 14):
        r = make_request(list(range(50, 50 + n)), f"n{n}")
        assert len(bm.find_cached_prefix(r)) * BS <= n - 1


def test_eviction_order_uncached_first_then_lru_tails_first() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_request(list(range(100, 113)), "a")  # 13 tokens: 3 full cached blocks + 1 partial
    b = make_request(list(range(200, 209)), "b")  # 9 tokens: 2 full cached blocks + 1 partial
    admit(bm, a)
    admit(bm, b)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    assert counts(bm) == (1, 5, 7)
    bm.free(a)  # a is freed first: its chain is the least recently used
    bm.free(b)
    assert counts(bm) == (8, 5, 0)
    uncached = {a_blocks[3], b_blocks[2]} | (set(range(8)) - set(a_blocks) - set(b_blocks))
    assert len(uncached) == 3

    # Fresh allocations take the three uncached blocks before evicting anything.
    x = make_request(list(range(300, 312)), "x")
    assert bm.allocate_slots(x, 12) is not None
    assert set(x.block_table) == uncached
    assert counts(bm) == (5, 5, 3)

    # Then cached blocks go in LRU order, and within a chain its tail first.
    expected = [a_blocks[2], a_blocks[1], a_blocks[0], b_blocks[1], b_blocks[0]]
    taken = []
    for i, block_id in enumerate(expected):
        y = make_request([400 + i], f"y{i}")
        assert bm.allocate_slots(y, 1) is not None
        taken.append(y.block_table[0])
        assert bm.blocks[block_id].block_hash is None  # evicted: no longer findable
        assert counts(bm) == (4 - i, 4 - i, 4 + i)
    assert taken == expected
    assert counts(bm) == (0, 0, 8)


def test_partial_eviction_keeps_the_prefix_head() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_request(list(range(100, 113)), "a")  # 4 blocks, 3 cached
    admit(bm, a)
    a_blocks = list(a.block_table)
    bm.free(a)
    y = make_request(list(range(500, 508)), "y")  # 2 blocks: the uncached tail, then a's last full block
    assert bm.allocate_slots(y, 8) is not None
    assert y.block_table == [a_blocks[3], a_blocks[2]]
    again = make_request(list(range(100, 113)), "again")
    assert bm.find_cached_prefix(again) == a_blocks[:2]


def test_constant_hash_never_returns_another_prompts_blocks() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS, hash_fn=lambda parent, tokens: 0)
    a = make_request(list(range(10, 22)), "a")  # 3 full blocks
    admit(bm, a)
    a_blocks = list(a.block_table)
    assert bm.num_cached_blocks == 1  # every block hashes to 0: only the first is registered
    bm.free(a)

    other = make_request(list(range(60, 72)) + [1], "other")  # different first block
    assert bm.find_cached_prefix(other) == []
    same_head = make_request(list(range(10, 14)) + list(range(90, 98)) + [1], "same_head")
    assert bm.find_cached_prefix(same_head) == a_blocks[:1]
    identical = make_request(list(range(10, 22)) + [1], "identical")
    assert bm.find_cached_prefix(identical) == a_blocks[:1]  # later blocks were never registered
    # A prompt whose second block repeats the first: the cached block (a first block, parent None)
    # must not be served at position 1.
    repeat = make_request(list(range(10, 14)) * 3 + [1], "repeat")
    assert len(bm.find_cached_prefix(repeat)) == 1
    # Admitting a colliding prompt computes its own blocks and leaves a's registration alone.
    assert admit(bm, other) == []
    assert not set(other.block_table) & set(a_blocks[:1])
    assert bm.find_cached_prefix(same_head) == a_blocks[:1]


@pytest.mark.parametrize(
    "hash_fn",
    [
        default_block_hash,
        lambda parent, tokens: 0,
        lambda parent, tokens: tokens[0] % 2,  # ignores the parent: every level collides
        lambda parent, tokens: hash((parent, tokens[0] % 3)),  # chained, colliding within a level
    ],
    ids=["default", "constant", "first-token-no-parent", "chained-first-token"],
)
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_collisions_never_serve_wrong_kv(hash_fn, seed: int) -> None:
    """Random admit/compute/free traffic over a tiny alphabet under a colliding hash: every hit block
    was computed by a request whose tokens up to and including that block equal the new request's.

    The test records, per physical block, the token prefix its K/V were computed with (what the
    model would have stored), so hits are checked against real content, not hashes. Requests are
    computed in chunks, so prompts sharing a prefix are often in flight together (duplicate blocks).
    """
    rng = random.Random(seed)
    bs = 2
    bm = BlockManager(num_blocks=12, block_size=bs, hash_fn=hash_fn)
    computed_with: dict[int, tuple[int, ...]] = {}  # block id -> token prefix its K/V depend on
    live: list[Request] = []

    def compute(r: Request, upto: int) -> None:
        for i in range(r.num_computed_tokens // bs, upto // bs):
            computed_with[r.block_table[i]] = tuple(r.token_ids[: (i + 1) * bs])
        r.num_computed_tokens = upto
        bm.cache_full_blocks(r)

    num_hits = 0
    for step in range(500):
        action = rng.random()
        partial = [r for r in live if r.num_computed_tokens < r.num_tokens]
        if live and (action < 0.3 or bm.num_free_blocks < 4):
            bm.free(live.pop(rng.randrange(len(live))))
        elif partial and action < 0.6:
            r = rng.choice(partial)
            compute(r, rng.randint(r.num_computed_tokens + 1, r.num_tokens))
        else:
            r = make_request([rng.randrange(3) for _ in range(rng.randint(2, 9))], f"s{step}")
            hits = bm.find_cached_prefix(r)
            for i, block_id in enumerate(hits):
                assert computed_with[block_id] == tuple(r.token_ids[: (i + 1) * bs]), (
                    f"step {step}: block {block_id} served at position {i} holds K/V of another prefix"
                )
            num_hits += len(hits)
            hit = bm.allocate_slots(r, r.num_tokens - bs * len(hits), hits)
            if hit is None:
                continue
            r.num_computed_tokens = hit
            live.append(r)
            compute(r, rng.randint(r.num_computed_tokens, r.num_tokens))
        check_consistent(bm, live)
    assert num_hits > 0  # the traffic did exercise the cache


def test_swap_out_and_in_counts() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, num_swap_blocks=4)
    r = make_request(list(range(10, 20)), "r")  # 10 tokens -> 3 blocks
    admit(bm, r)
    other = make_request(list(range(40, 48)), "other")  # 2 blocks
    admit(bm, other)
    assert counts(bm)[0] == 3 and len(bm.free_swap_blocks) == 4
    assert bm.can_swap_out(r)
    device_blocks = list(r.block_table)
    mapping = bm.swap_out(r)
    assert [dev for dev, _ in mapping] == device_blocks
    assert len({cpu for _, cpu in mapping}) == 3
    assert r.swap_table == [cpu for _, cpu in mapping] and r.block_table == []
    assert len(bm.free_swap_blocks) == 1
    assert bm.num_free_blocks == 6 and bm.num_used_blocks == 2
    # Not enough swap space left for another 2-block request.
    assert not bm.can_swap_out(other)

    # Fill the device so the swapped request cannot come back yet: 4 tokens (computed 10 + 1 new
    # = 11 tokens = 3 blocks) need 3 free blocks.
    filler = make_request(list(range(70, 86)), "filler")  # 4 blocks
    assert bm.allocate_slots(filler, 16) == 0
    assert bm.num_free_blocks == 2
    assert not bm.can_swap_in(r, 1)
    bm.free(filler)
    assert bm.can_swap_in(r, 1)
    r.token_ids.append(99)  # the token sampled before preemption, still to be computed
    copies = bm.swap_in(r, 1)
    assert [cpu for cpu, _ in copies] == [cpu for _, cpu in mapping]
    assert r.block_table == [dev for _, dev in copies] and len(r.block_table) == 3
    assert r.swap_table == [] and len(bm.free_swap_blocks) == 4
    assert bm.num_used_blocks == 5 and bm.num_free_blocks == 3
    check_consistent(bm, [r, other])
    # Growing past the last block on swap-in takes an extra block.
    r.num_computed_tokens = 11
    r.token_ids.append(98)
    assert bm.allocate_slots(r, 1) == 0
    assert len(r.block_table) == 3
    r.num_computed_tokens = 12
    r.token_ids.append(97)
    bm.swap_out(r)
    assert bm.swap_in(r, 1) and len(r.block_table) == 4
    check_consistent(bm, [r, other])
