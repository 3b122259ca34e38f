"""A scheduler decision as the model runner takes it: one `StepInput` per scheduled request, with
its tokens, block table and sampling settings (no request objects cross into the runner)."""

from __future__ import annotations

from batchgen.engine.logprobs import scored_rows
from batchgen.engine.request import Request
from batchgen.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from batchgen.model.sampler import RowPenalty
from batchgen.model.step import StepInput


def step_inputs(sched: SchedulerOutput, persistent: bool = False) -> list[StepInput]:
    """The runner's inputs for `sched`, in its order.

    `persistent`: a plain decode's `StepInput` is the request's own (`Request.decode_input`), kept
    between steps and updated in place (its token and position), so a step that decodes the same
    requests as the step before hands the runner the same objects, which `flat_step.DecodeRows`
    recognizes to keep its arrays. Only where no earlier step's inputs are still in use (not with
    overlapped steps, `engine.overlap`).

    A sampling request below `min_tokens` bans its EOS and stop ids; one with penalties brings its
    tokens (`RowPenalty`); one that asks for prompt log probabilities its scored rows
    (`logprobs.scored_rows`); one with structured outputs brings its matcher (`token_mask`), first
    brought in line with its output tokens (`RequestGrammar.sync`: a no-op unless they differ).

    Raises:
        RuntimeError: a structured request's own output tokens do not fit its grammar (cannot
            happen unless its tokens were changed from outside).
    """
    inputs = []
    for item in sched.scheduled:
        r = item.request
        if item.num_new_tokens != 1 or not item.samples:
            inputs.append(_general_input(item))
            continue
        # A request's own decode input exists only once its decodes are plain, and a plain
        # request stays plain (its settings are fixed, and it only grows past `min_tokens`).
        kept = r.decode_input if persistent else None
        if kept is not None and kept.block_table is r.block_table:
            kept.token_ids[0] = r.token_ids[item.start]
            kept.start = item.start
            inputs.append(kept)
            continue
        if _plain_decode(r):
            # The usual decode (no drafts, bans, penalties, log probabilities or mask): positional,
            # one call a running request a step.
            p = r.sampling_params
            inputs.append(
                StepInput(
                    [r.token_ids[item.start]],
                    item.start,
                    r.block_table,
                    True,
                    0,
                    0.0 if p.greedy else float(p.temperature),
                    p.top_k,
                    p.top_p,
                    p.min_p,
                    r.generator,
                    None,
                    None,
                    None,
                    None,
                    None,
                    r.num_prompt_tokens,
                )
            )
            if persistent:
                r.decode_input = inputs[-1]
            continue
        inputs.append(_general_input(item))
    return inputs


def _plain_decode(r: Request) -> bool:
    """Whether a decode of `r` needs none of `StepInput`'s optional parts: past `min_tokens`,
    no penalty, log probabilities, prompt scoring or token mask."""
    p = r.sampling_params
    return (
        r.grammar is None
        and p.logprobs is None
        and r.prompt_logprobs is None
        and len(r.token_ids) - r.num_prompt_tokens >= p.min_tokens
        and not p.penalized
    )


def _general_input(item: ScheduledRequest) -> StepInput:
    """The `StepInput` of any scheduled request that is not a plain decode (see `step_inputs`)."""
    r = item.request
    p = r.sampling_params
    banned = None
    if item.samples and r.num_output_tokens < p.min_tokens:
        banned = sorted(r.eos_token_ids | set(p.stop_token_ids or ()))
    mask = r.grammar if item.samples else None
    if mask is not None and not mask.sync(r.output_token_ids):
        raise RuntimeError(f"request {r.request_id!r}: its output tokens do not fit its grammar")
    drafts = item.spec_token_ids
    return StepInput(
        token_ids=r.token_ids[item.start : item.start + item.num_new_tokens - len(drafts)] + drafts,
        start=item.start,
        num_prompt_tokens=r.num_prompt_tokens,
        block_table=r.block_table,
        sample=item.samples,
        num_draft_tokens=len(drafts),
        temperature=0.0 if p.greedy else float(p.temperature),
        top_k=p.top_k,
        top_p=p.top_p,
        min_p=p.min_p,
        generator=r.generator,
        banned_token_ids=banned,
        penalty=RowPenalty(
            r.token_ids,
            r.num_prompt_tokens,
            p.presence_penalty,
            p.frequency_penalty,
            p.repetition_penalty,
        )
        if item.samples and p.penalized
        else None,
        logprobs=p.logprobs if item.samples else None,
        scored=scored_rows(r, item.start, item.num_new_tokens - len(drafts)),
        token_mask=mask,
    )
