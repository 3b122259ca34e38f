"""`batchgen plan`: what a job will cost before it runs, from its file and the model's tokenizer, and
its wall time from a few steps measured on this machine.

The rows go through the same reader, sampling columns and error rules as `batchgen run`
(`prepare_row`, the engine's stop-token check), so the error rows and the prompt-token counts are
the ones `run` writes. A structured outputs constraint that does not compile (the job's distinct
constraints are compiled once the rows are read, as the engine compiles them) makes its rows error
rows in run: when there is one, the job is read a second time with those rows as error rows, so
they take no place in the token counts or the schedule. The token counts load no weights: the KV-cache size comes from the same
sizing rules as the engine's (`batchgen.engine.sizing`). The wall time (`batchgen.plan.wall_time`)
simulates the job's schedule at step costs measured by a calibration run of a few steps (the model
is loaded for it, once per machine and job shape: the result is cached; `--no-calibrate` skips it).
Memory stays bounded: a sequence keeps six integers (prompt, cached prompt, output budget, window
work, priority, where its prompt blocks start) and, for the replay of its schedule, its full prompt
blocks' hashes up to `REPLAY_MAX_BLOCKS` in all; the prefix-cache estimate is the engine's
`BlockManager` over the cache's blocks.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from batchgen.jobs.errors import JobInputError
from batchgen.jobs.options import JobOptions, check_output_path, flag_hint, output_format
from batchgen.jobs.output.resume import check_output_location
from batchgen.plan.grammars import GrammarReport, as_request, failing, report
from batchgen.plan.inputs import TokenizerEngine, committed_rows
from batchgen.plan.prefix import PrefixEstimate
from batchgen.plan.schedule import Sequences
from batchgen.plan.tally import Tally, read_rows
from batchgen.plan.wall_time import WallTimeEstimate, WallTimeOptions, duration, expected_outputs


@dataclass
class JobPlan:
    """What `plan` prints (`--json`: this as a dict). Token figures are over the rows that will run."""

    input: str
    model: str
    quantization: str = "auto"  # the run's `quantization` option (the calibration runs it)
    rows: int = 0
    rows_resumed: int = 0  # committed by an earlier run: not planned
    rows_valid: int = 0
    rows_error: int = 0
    rows_too_long: int = 0
    first_errors: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    prompt_tokens_p50: int = 0
    prompt_tokens_p99: int = 0
    prompt_tokens_max: int = 0
    max_output_tokens: int = 0  # the output budget: each row's max_tokens (times n), capped by room
    prefix_caching: bool = True
    prefix_cache_tokens: int = 0  # prompt tokens the prefix cache would serve (full shared blocks)
    max_model_len: int = 0
    block_size: int = 0
    kv_cache_tokens: int = 0  # what the KV cache holds
    kv_bytes_per_token: int = 0
    weight_bytes: int = 0  # the weights as run, under the quantization (`WeightEstimate`)
    weights: str = ""  # what weight_bytes counts (`WeightEstimate.describe`)
    largest_row_tokens: int = 0  # prompt + output budget of the largest row
    largest_row_kv_bytes: int = 0
    max_num_seqs: int = 0
    typical_row_tokens: int = 0  # p50 prompt + mean output budget
    seqs_that_fit: int = 0  # typical rows the KV cache holds at once (at most max_num_seqs run)
    expected_output_tokens: int = 0  # the output expected: see expected_output_basis
    expected_output_basis: str = ""
    wall_time: WallTimeEstimate | None = None
    wall_time_note: str | None = None  # why there is no wall time estimate
    note: str | None = None  # about the rows an earlier run committed
    structured: GrammarReport | None = None  # the job's structured outputs constraints, compiled

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def _open_job(options: JobOptions, engine: Any, torch_free: bool) -> tuple[Any, ...]:
    """(engine config, reader, tokenizer engine, committed rows, their outputs, a note on them)."""
    from batchgen.jobs.runner import check_run_options, job_header, job_reader, validate_job

    # The device is checked where torch is: TokenizerEngine's sizes (in a child with torch_free).
    config = check_run_options(options, check_device=engine is not None)
    reader = job_reader(options)
    output = options.output_path(reader.format)
    check_output_path(output, options.input)  # run's own checks: plan refuses what run would
    check_output_location(output)
    if options.strict:
        validate_job(reader)
    fmt = output_format(output, reader.format)
    committed, outputs, note = (
        (None, None, None) if options.overwrite else committed_rows(output, job_header(options, reader, fmt))
    )
    if engine is None:
        from batchgen.model.loading.architectures import ModelNotFoundError

        try:
            engine = TokenizerEngine(config, torch_free=torch_free)
        except (ModelNotFoundError, ValueError) as e:
            raise JobInputError(
                f"cannot plan for model {config.model or '(default)'}: {e}{flag_hint(str(e))}"
            ) from e
    return config, reader, engine, committed, outputs, note


def _fill_sizes(plan: JobPlan, tally: Tally, engine: TokenizerEngine, max_num_seqs: int) -> None:
    """Token statistics and the KV cache's fit, from the rows read."""
    plan.rows_valid = len(tally.prompts)
    plan.max_model_len = engine.max_model_len
    plan.block_size = engine.block_size
    plan.kv_cache_tokens = engine.num_blocks * engine.block_size
    plan.kv_bytes_per_token = engine.bytes_per_block // engine.block_size
    plan.max_num_seqs = max_num_seqs
    weights = getattr(engine, "weights", None)  # a TokenizerEngine's; a stand-in engine may have none
    if weights is not None:
        plan.weight_bytes, plan.weights = weights.total_bytes, weights.describe()
    if tally.prefix is not None:
        plan.prefix_cache_tokens = tally.prefix.hit_tokens
    if not tally.prompts:
        return
    p, b = np.array(tally.prompts, dtype=np.int64), np.array(tally.budgets, dtype=np.int64)
    plan.prompt_tokens = int(p.sum())
    plan.prompt_tokens_p50 = int(np.percentile(p, 50, method="nearest"))
    plan.prompt_tokens_p99 = int(np.percentile(p, 99, method="nearest"))
    plan.prompt_tokens_max = int(p.max())
    plan.max_output_tokens = int(b.sum())
    plan.largest_row_tokens = int((p + b).max())
    plan.largest_row_kv_bytes = _blocks(plan.largest_row_tokens, engine.block_size) * engine.bytes_per_block
    plan.typical_row_tokens = plan.prompt_tokens_p50 + math.ceil(float(b.mean()))
    per_row = _blocks(plan.typical_row_tokens, engine.block_size)
    plan.seqs_that_fit = min(engine.num_blocks // max(per_row, 1), max_num_seqs)


def _sequences(plan: JobPlan, tally: Tally, given: int | None) -> Sequences:
    """The sequences to run, with their expected outputs (also summed into `plan`)."""
    arrays = {k: np.array(a, dtype=np.int64) for k, a in tally.seq.items()}
    hashes = None if tally.hashes is None else np.array(tally.hashes, dtype=np.int64)
    offsets = None if tally.offsets is None else np.array(tally.offsets, dtype=np.int64)
    seqs = Sequences(
        arrays["prompts"],
        arrays["cached"],
        arrays["budgets"],
        first=np.array(tally.first, dtype=bool),
        scores_prompt=np.array(tally.scores, dtype=bool),
        work=arrays["work"],
        priority=arrays["priority"],
        block_hashes=hashes,
        block_offsets=offsets,
    )
    fraction = tally.committed_completion / tally.committed_budget if tally.committed_budget else None
    seqs.expected, seqs.basis = expected_outputs(seqs.budgets, given, fraction)
    plan.expected_output_basis = seqs.basis
    plan.expected_output_tokens = int(seqs.expected.sum())
    return seqs


def _read_job(
    job: tuple[Any, ...], options: JobOptions, progress: bool, failing: dict[str, str] | None = None
) -> tuple[JobPlan, Tally]:
    """A plan of `_open_job`'s job with its rows read (`read_rows`); `failing`: the constraints
    whose rows are error rows."""
    config, reader, engine, committed, outputs, note = job
    plan = JobPlan(reader.source, engine.model_name or str(config.model or "default"), note=note)
    plan.prefix_caching = config.enable_prefix_caching
    plan.quantization = config.quantization
    prefix = PrefixEstimate(engine.block_size, engine.num_blocks) if config.enable_prefix_caching else None
    tally = Tally(plan, prefix, engine.block_size)
    rows: Any = reader
    if progress:
        from tqdm import tqdm

        desc = "tokenizing" if failing is None else "tokenizing again, without the failed constraints' rows"
        rows = tqdm(reader, total=reader.count_rows(), unit=" rows", desc=desc, disable=None, leave=False)
    read_rows(tally, options, rows, engine, committed, outputs, failing)
    return plan, tally


def plan_job(
    options: JobOptions,
    engine: Any = None,
    progress: bool = False,
    wall_time: WallTimeOptions | None = None,
    torch_free: bool = False,
) -> JobPlan:
    """Read the job (streaming) and tokenize every row as `run` would; nothing is written.

    Args:
        options: the job, as `batchgen run` takes it.
        engine: anything with TokenizerEngine's attributes (default: a TokenizerEngine).
        progress: a progress bar on stderr while rows are tokenized (only on a terminal).
        wall_time: estimate the wall time too (`batchgen.plan.wall_time`: may load the model for a
            calibration of a few steps); None: no estimate.
        torch_free: keep torch out of this process (`TokenizerEngine`), for one that ends after
            the plan, as the CLI's does: a plan's memory is then mostly the job's, not torch's.

    Raises:
        JobInputError: the input, its schema, the options or the model cannot be used, or the
            calibration's engine cannot be built.
    """
    from batchgen.model.loading.architectures import ModelNotFoundError
    from batchgen.plan.schedule import ScheduleLimits
    from batchgen.plan.wall_time import estimate_wall_time

    job = _open_job(options, engine, torch_free)
    config, reader, engine = job[:3]
    # From here: run reads and tokenizes the same rows (its start-up is the calibration's startup_s).
    start = time.perf_counter()
    plan, tally = _read_job(job, options, progress)
    read_s = time.perf_counter() - start
    if tally.constraints.rows:  # compiled as the engine would: the bad ones and the time it takes
        results = engine.compile_grammars(config, as_request(tally.constraints))
        structured = report(tally.constraints, results)
        if bad := failing(tally.constraints, results):
            # run makes their rows error rows, which take no tokens: read the job again so.
            plan, tally = _read_job(job, options, progress, bad)
        plan.structured = structured
    _fill_sizes(plan, tally, engine, config.max_num_seqs)
    seqs = _sequences(plan, tally, wall_time.expected_output_tokens if wall_time else None)
    del tally  # the rows as read, and the estimate's blocks: the schedules build their own
    if wall_time is None:
        return plan
    limits = ScheduleLimits(
        config.max_num_seqs,
        engine.max_num_batched_tokens,
        engine.num_blocks,
        engine.block_size,
        config.enable_chunked_prefill,
        config.enable_prefix_caching,
        config.preemption_mode,
        engine.num_swap_blocks,
        config.policy,
        config.aging_steps,
        options.window,
        engine.max_model_len,
    )
    # Read before a calibration, which measures the kernels where the table was not cached.
    wall_time = replace(wall_time, kernels_cached=getattr(engine, "kernels_cached", True))
    try:
        plan.wall_time, plan.wall_time_note = estimate_wall_time(
            seqs, limits, config, engine.dtype, read_s, wall_time, engine.device, engine.measure
        )
    except (ModelNotFoundError, ValueError) as e:
        raise JobInputError(f"cannot calibrate model {config.model or '(default)'}: {e}") from e
    return plan


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _wall_time_lines(plan: JobPlan) -> list[str]:
    w = plan.wall_time
    if w is None:
        return [f"estimated wall time: none ({plan.wall_time_note})"] if plan.wall_time_note else []
    kernels = "" if w.kernel_measure_s is None else f", {w.kernel_measure_s:.1f} s of it measuring kernels"
    return [
        f"estimated wall time: {duration(w.low_s)} to {duration(w.high_s)} (model load and set-up "
        f"{w.startup_s:.1f} s{kernels}, reading and tokenizing the job {w.tokenize_s:.1f} s included; {w.low_steps} to "
        f"{w.high_steps} steps, up to {w.peak_seqs} rows at once)",
        f"  assuming {w.assumption}",
        f"  step times: {w.rates}",
    ]


def format_plan(plan: JobPlan) -> str:
    """The plan as the lines `batchgen plan` prints."""
    resumed = f"{plan.rows_resumed} committed by an earlier run; of the rest " if plan.rows_resumed else ""
    saved = 100 * plan.prefix_cache_tokens / plan.prompt_tokens if plan.prompt_tokens else 0.0
    lines = [
        f"job: {plan.input} (model {plan.model}, quantization {plan.quantization})",
        f"rows: {plan.rows} ({resumed}{plan.rows_valid} valid, {plan.rows_error} error rows, "
        f"{plan.rows_too_long} of them too long for max_model_len {plan.max_model_len})",
        f"prompt tokens: {plan.prompt_tokens} (p50 {plan.prompt_tokens_p50}, p99 {plan.prompt_tokens_p99}, "
        f"max {plan.prompt_tokens_max})",
        f"output budget: {plan.max_output_tokens} tokens (each row's max_tokens, capped by max_model_len); "
        f"expected about {plan.expected_output_tokens}: {plan.expected_output_basis}",
        f"prefix cache: about {plan.prefix_cache_tokens} prompt tokens ({saved:.0f}%) served from shared "
        f"prefixes of {plan.block_size}-token blocks"
        if plan.prefix_caching
        else "prefix cache: off (--no-enable-prefix-caching)",
        *([f"weights: {_mib(plan.weight_bytes)} as run ({plan.weights})"] if plan.weights else []),
        f"KV cache: {plan.kv_cache_tokens} tokens at {plan.kv_bytes_per_token} bytes a token; the largest row "
        f"needs {plan.largest_row_tokens} tokens ({_mib(plan.largest_row_kv_bytes)}); "
        f"{plan.seqs_that_fit} typical rows ({plan.typical_row_tokens} tokens) fit at once, "
        f"max_num_seqs {plan.max_num_seqs}",
    ]
    lines += _wall_time_lines(plan)
    if plan.note:
        lines.append(f"note: {plan.note}")
    if plan.structured is not None:
        lines += plan.structured.lines()
    if plan.first_errors:
        lines.append(f"first error rows ({len(plan.first_errors)} of {plan.rows_error}):")
        lines += [f"  {e}" for e in plan.first_errors]
    return "\n".join(lines)
