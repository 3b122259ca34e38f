"""The step contract between the engine and the model runner: what one sequence brings to a step
(`StepInput`, with `ScoredRows` where it asks for prompt log probabilities), what the step sampled
(`StepOutput`), and which sequences are decodes (`is_decode`).

No request objects cross this line: the runner sees token ids, positions and block tables only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # types only: the scheduler imports this contract without torch (`batchgen plan`)
    import torch

    from batchgen.model.sampler import RowPenalty, SampleLogprobs


def is_decode(num_new_tokens: int, samples: bool) -> bool:
    """Whether a sequence's share of a step is a decode: one new token whose logits are sampled.

    The one definition used by the scheduler (decodes go first in a step), the runner (the leading
    decodes take the attention backends' decode path) and the engine's step statistics (decode
    tokens are not prompt tokens). A one-token prompt counts as a decode: it has the same shape.
    """
    return num_new_tokens == 1 and samples


@dataclass
class ScoredRows:
    """Rows of a sequence's share of a step whose logits are scored against known next tokens
    (prompt log probabilities): rows `first` to `first + len(targets) - 1` of its `token_ids`.

    Attributes:
        first: index into the step's `token_ids` of the first scored row.
        targets: per scored row, the token that follows it (the one whose log probability and
            rank come back).
        top: how many most likely tokens to return at each scored row (0 to 20).
    """

    first: int
    targets: list[int]
    top: int


class TokenMask(Protocol):
    """The tokens a sequence may sample next (a structured output's grammar matcher,
    `batchgen.engine.structured.RequestGrammar`), as the runner asks for them."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed tokens into `bitmask[row]`: int32 words on the CPU, bit `t % 32` of
        word `t // 32` set when token `t` may be sampled. False when every token may (no mask)."""
        ...


@dataclass(slots=True)
class StepInput:
    """One sequence's share of a step, as the runner needs it (no request objects below the engine).

    Attributes:
        token_ids: the step's new tokens (`start` to `start + len`).
        start: position of the first new token.
        block_table: the sequence's physical blocks.
        sample: whether to sample a token after this step.
        num_draft_tokens: how many of the last `token_ids` are speculative draft tokens (needs
            `sample`): a token is sampled at each of the last `num_draft_tokens + 1` positions (the
            model's next token after the last real token and after each draft), so the engine can
            verify the drafts; the runner itself knows nothing of drafts.
        temperature / top_k / top_p / min_p / generator / banned_token_ids: sampling settings.
        penalty: the sequence's penalties and tokens (`RowPenalty`), None when it has none.
        logprobs: how many top log probabilities to return with the sampled token (None: none).
        scored: rows whose logits are scored (prompt log probabilities); None for the usual
            sequence, whose logits are computed at its sampled positions only.
        token_mask: the tokens the sampled token may be (`TokenMask`), None: any; never with draft
            tokens.
        num_prompt_tokens: the sequence's prompt length (Phi-3's LongRoPE picks its frequencies by
            it); 0 where the caller does not say (a benchmark's synthetic step).
    """

    token_ids: list[int]
    start: int
    block_table: list[int]
    sample: bool
    num_draft_tokens: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    generator: torch.Generator | None = None
    banned_token_ids: list[int] | None = None
    penalty: RowPenalty | None = None
    logprobs: int | None = None
    scored: ScoredRows | None = None
    token_mask: TokenMask | None = None
    num_prompt_tokens: int = 0

    @property
    def is_decode(self) -> bool:
        return is_decode(len(self.token_ids), self.sample)

    @property
    def num_sampled(self) -> int:
        """Tokens sampled for this sequence: 0 without `sample`, else `num_draft_tokens + 1`."""
        return self.num_draft_tokens + 1 if self.sample else 0


@dataclass
class StepOutput:
    """What a step sampled: for each sequence with `sample` set, in order, its `num_sampled` token
    ids (one, or one per draft token plus one), flat; for each token its `SampleLogprobs` (None where
    the sequence asked for none) and, in `errors`, why it is not valid (NaN logits), else None;
    `errors` None = no error in the step. `scored`: per input sequence, in order, the
    `SampleLogprobs` of its `ScoredRows` targets (None where it has none); None = none in the step.
    `mask_time_s`: host seconds spent filling and applying token masks (`TokenMask`) in the step.

    Where the runner's time went, in seconds: `prepare_s` flattening the inputs into tensors
    (`ModelRunner.prepare`), `forward_s` the model's forward (and prompt log-probability scoring),
    `sample_s` the sampler, log probabilities and the NaN check, the masks excluded. On a CPU each
    is the work itself; on a GPU the forward only queues kernels and the sampled ids' copy to the
    host waits for them, so the device's time lands in `sample_s`."""

    token_ids: list[int]
    logprobs: list[SampleLogprobs | None]
    errors: list[str | None] | None = None
    scored: list[list[SampleLogprobs] | None] | None = None
    mask_time_s: float = 0.0
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
