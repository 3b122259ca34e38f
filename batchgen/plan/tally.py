"""What `batchgen plan` keeps of the rows it reads (`Tally`), and the reading itself (`read_rows`):
each row taken as `batchgen run` takes it, through the same reader, `prepare_row` and error rules."""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import Protocol

from batchgen.jobs.input.rows import JobRow
from batchgen.jobs.loop import window_work
from batchgen.jobs.options import JobOptions
from batchgen.jobs.output.manifest import CommittedRows
from batchgen.jobs.requests import prepare_row
from batchgen.plan.estimate import REPLAY_MAX_BLOCKS
from batchgen.plan.grammars import Constraints, row_error
from batchgen.plan.inputs import CommittedOutputs, TokenizerEngine
from batchgen.plan.prefix import PrefixEstimate
from batchgen.sampling_params import SamplingParams

FIRST_ERRORS = 5  # error rows the plan lists


class RowCounts(Protocol):
    """What the reading counts into (`batchgen.plan.job_plan.JobPlan`'s fields of the same names)."""

    rows: int
    rows_resumed: int
    rows_error: int
    rows_too_long: int
    first_errors: list[str]


class Tally:
    """What the plan keeps of the rows it reads: per row its prompt and output budget, per sequence
    (n of a row) what the schedule needs (`Sequences`), and the output an earlier run's rows used."""

    def __init__(self, plan: RowCounts, prefix: PrefixEstimate | None, block_size: int) -> None:
        self.plan = plan
        self.prefix = prefix
        self.block_size = block_size
        self.prompts, self.budgets = array("q"), array("q")  # per row; budgets times n
        self.seq: dict[str, array] = {
            k: array("q") for k in ("prompts", "cached", "budgets", "work", "priority")
        }
        self.first, self.scores = array("b"), array("b")
        # The sequences' full prompt blocks for the replay; None once more than it would replay.
        self.hashes: array | None = array("q")
        self.offsets: array | None = array("q", [0])
        self.committed_budget = self.committed_completion = 0
        self.constraints = Constraints()  # the valid rows' structured outputs constraints

    def error(self, message: str) -> None:
        self.plan.rows_error += 1
        if len(self.plan.first_errors) < FIRST_ERRORS:
            self.plan.first_errors.append(message)

    def row(self, token_ids: list[int], budget: int, sp: SamplingParams, work: int) -> None:
        """A valid row: `budget` output tokens a sequence, `sp.n` sequences, `work` in the window;
        a row asking for prompt log probabilities takes no prefix-cache hits for its first sequence
        (as the engine: the sequence that scores the prompt)."""
        prompt = len(token_ids)
        self.prompts.append(prompt)
        self.budgets.append(sp.n * budget)
        scores = sp.prompt_logprobs is not None
        hits, hashes = self.prefix.add(token_ids, served=not scores) if self.prefix is not None else (0, [])
        # Siblings (n > 1) are admitted once the first one's prompt blocks are cached.
        sibling_hits = (prompt - 1) // self.block_size * self.block_size if self.prefix is not None else 0
        seq = self.seq
        for i in range(sp.n):
            seq["prompts"].append(prompt)
            seq["cached"].append(hits if i == 0 else sibling_hits)
            seq["budgets"].append(budget)
            seq["work"].append(work)
            seq["priority"].append(sp.priority)
            self.first.append(i == 0)
            self.scores.append(scores and i == 0)
            if self.hashes is not None and self.offsets is not None:
                self.hashes.extend(hashes)
                self.offsets.append(len(self.hashes))
        if self.hashes is not None and len(self.hashes) > REPLAY_MAX_BLOCKS:
            self.hashes = self.offsets = None

    def committed(
        self, outputs: CommittedOutputs | None, row_index: int, sp: SamplingParams | None, max_len: int
    ) -> None:
        """A row an earlier run committed: its output against its budget, when it ran."""
        found = outputs.lookup(row_index) if outputs is not None else None
        if found is not None and sp is not None:  # it ran: not an error row
            prompt, completion = found
            room = max(max_len - prompt, 1)
            self.committed_budget += sp.n * (room if sp.max_tokens is None else min(sp.max_tokens, room))
            self.committed_completion += completion


def read_rows(
    tally: Tally,
    options: JobOptions,
    reader: Iterable[JobRow],
    engine: TokenizerEngine,
    committed: CommittedRows | None,
    outputs: CommittedOutputs | None,
    failing: dict[str, str] | None = None,
) -> None:
    """Every row as `run` would take it: committed, error row, or a valid row with its tokens.
    `failing`: the constraints that do not compile (`grammars.failing`): their rows are error rows,
    with run's message, as the reader makes a constraint the library refuses."""
    plan = tally.plan
    tokenizer = engine.tokenizer
    chat = options.chat_template and bool(getattr(tokenizer, "chat_template", None))
    bos = getattr(tokenizer, "bos_token_id", None)
    max_len = engine.max_model_len
    for row in reader:
        plan.rows = row.row_index + 1
        if committed is not None and committed.is_committed(row.row_index, row.row_hash, row.where):
            plan.rows_resumed += 1
            tally.committed(outputs, row.row_index, row.sampling_params, max_len)
            continue
        if row.error is not None:
            tally.error(row.error)
            continue
        constraint = row.params.structured_outputs if failing else None
        if constraint is not None and failing is not None and constraint.key in failing:
            label = row.constraint_field or f"structured_outputs.{constraint.kind}"
            tally.error(row_error(row.where, label, failing[constraint.key]))
            continue
        prepared, message = prepare_row(row, engine, options, chat, bos, max_len)
        if message is not None:
            plan.rows_too_long += prepared is not None
            tally.error(message)
            continue
        assert prepared is not None and prepared.token_ids is not None  # a row, no engine took its ids
        sp = row.params
        unknown = [t for t in sp.stop_token_ids or () if t >= engine.vocab_limit]
        if unknown:  # the engine's own check (LLMEngine._add_one), worded as run's error row
            tally.error(
                f"{row.where}: stop_token_ids holds ids outside the vocabulary [0, {engine.vocab_limit}): "
                f"{unknown[:5]}; fix or remove them"
            )
            continue
        room = max_len - prepared.prompt_tokens
        budget = room if sp.max_tokens is None else min(sp.max_tokens, room)
        tally.row(
            prepared.token_ids, budget, sp, window_work(prepared.prompt_tokens, sp.n, sp.max_tokens, max_len)
        )
        if sp.structured_outputs is not None:
            tally.constraints.add(sp.structured_outputs, row.where, row.constraint_field)
