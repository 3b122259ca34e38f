"""`batchgen plan`'s prefix-cache estimate: the engine's own `BlockManager` over the rows in file
order, and the stand-in token ids the plan gives the engine's objects for a prompt.

A prompt's full blocks are named by their chain hashes, `BlockManager.hash_fn(parent, block's ids)`
as the block manager computes them. The stand-in ids of a prompt put each full block's hash first
and zeros after it, so two stand-in blocks hold the same ids exactly when the prompts share that
prefix: the block manager caches and finds them as it would the real ones, keeping one large int a
block instead of `block_size` of them (a plan of 200,000 rows keeps up to the cache's blocks).
"""

from __future__ import annotations

from batchgen.engine.block_manager import BlockManager
from batchgen.engine.request import Request
from batchgen.sampling_params import SamplingParams


def stand_in_prompt(hashes: list[int], length: int, block_size: int, own_id: int) -> list[int]:
    """Token ids standing in for a prompt of `length` tokens whose full blocks have these chain
    `hashes`: each block its hash then zeros, the partial tail `own_id` (an id of the sequence's
    own: a negative one never meets a real or another sequence's id)."""
    ids: list[int] = []
    pad = [0] * (block_size - 1)
    for h in hashes:
        ids.append(h)
        ids += pad
    ids += [own_id] * (length - len(ids))
    return ids


class PrefixEstimate:
    """Prompt tokens a prefix cache of `capacity` blocks would serve with the rows in file order, one
    at a time: the engine's `BlockManager` (its block hashes, its LRU of freed blocks) takes each
    prompt's cached prefix and fresh blocks, caches its full blocks as if computed, and frees it."""

    def __init__(self, block_size: int, capacity: int) -> None:
        self.manager = BlockManager(capacity, block_size)
        self.params = SamplingParams()
        self.hit_tokens = 0

    def add(self, ids: list[int], served: bool = True) -> tuple[int, list[int]]:
        """Look a prompt's full blocks up, then cache them: (its prompt tokens served, the chain
        hashes of its full blocks). Not `served`: the prompt asks for log probabilities, and the
        block manager serves it none (`Request.max_cached_prefix`)."""
        bm = self.manager
        bs = bm.block_size
        hashes: list[int] = []
        parent = None
        for start in range(0, len(ids) - bs + 1, bs):
            parent = bm.hash_fn(parent, tuple(ids[start : start + bs]))
            hashes.append(parent)
        ids_in = stand_in_prompt(hashes, len(ids), bs, -1)
        request = Request("plan", ids_in, self.params, 0.0, 1, prompt_logprobs=None if served else [])
        cached = bm.find_cached_prefix(request)
        hits = bm.allocate_slots(request, len(ids) - len(cached) * bs, cached)
        if hits is None:  # a prompt larger than the whole cache (run rejects it: an error row)
            return 0, hashes
        request.num_computed_tokens = len(ids)
        bm.cache_full_blocks(request)
        bm.free(request)
        self.hit_tokens += hits
        return hits, hashes
