"""The `batchgen` command line (Typer). Thin: parses options and calls `batchgen.jobs.run_job`.

Exit codes of `batchgen run`: 0 done (error rows included: `--summary-json` gives their count), 3
done but every row of the job failed (the output holds the error rows), 2 bad input or options
(before any model work), 1 the output could not be written, 130 / 143 / 129 interrupted by SIGINT /
SIGTERM / SIGHUP (committed rows kept; the same command resumes).
"""

from __future__ import annotations

import inspect
import json
import os
import shlex
import signal
import sys
from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Annotated, Any

import typer

from batchgen import cli_types as opt
from batchgen.bench.cli import bench_command
from batchgen.config import POLICIES, EngineConfig
from batchgen.stop_signals import STOP_SIGNALS
from batchgen.tune import tune_command

if TYPE_CHECKING:
    from batchgen.distributed.pool import ReplicaOptions
    from batchgen.jobs.options import JobOptions, JobSummary

app = typer.Typer(
    name="batchgen",
    help="Offline LLM batch inference: job files in, generations out, resumable at any moment.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Click's plain help: rich's option tables cut long option names ("--max-num-batche…") at 80
    # columns, which is what `batchgen run --help | less` gets.
    rich_markup_mode=None,
)


@app.callback()
def main() -> None:
    """batchgen: offline LLM batch inference with continuous batching over a paged KV cache."""


@app.command("run")
def run_command(
    input: Annotated[
        str,
        typer.Argument(
            help="Job file (.jsonl, OpenAI batch .jsonl, .parquet), dataset dir, or hf://NAME[:CONFIG]:SPLIT"
        ),
    ],
    output: Annotated[
        str | None,
        typer.Option(
            help="Output file (default <input stem>.out.parquet; .out.jsonl for OpenAI batch input)"
        ),
    ] = None,
    overwrite: Annotated[
        bool, typer.Option(help="Discard committed rows / an existing output and start over")
    ] = False,
    strict: Annotated[
        bool, typer.Option(help="Validate every row first; fail before any model work")
    ] = False,
    # --- prompts ---
    template: Annotated[str | None, typer.Option(help="Prompt template with {column} placeholders")] = None,
    system_prompt: Annotated[
        str | None,
        typer.Option(
            help="System message for every chat prompt that has none (plain text prompts without a "
            "chat template get it as a first paragraph; OpenAI /v1/completions lines are left as they are)"
        ),
    ] = None,
    no_chat_template: Annotated[
        bool,
        typer.Option("--no-chat-template", help="Send plain prompts as raw text, not as a chat user turn"),
    ] = False,
    prompt_column: Annotated[str | None, typer.Option(help="Column holding prompt text")] = None,
    messages_column: Annotated[str | None, typer.Option(help="Column holding chat messages")] = None,
    id_column: Annotated[str | None, typer.Option(help="Column holding the row id")] = None,
    keep_columns: Annotated[
        list[str] | None,
        typer.Option(help="Input columns copied to the output (comma-separated or repeated)"),
    ] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="Run only the first N rows of the input")] = None,
    truncate_prompt: Annotated[
        str | None,
        typer.Option(
            help="Cut over-long prompts on the left or right instead of an error row "
            "(chat prompts are cut inside the message text; the template stays whole)",
        ),
    ] = None,
    # --- sampling defaults (row columns override) ---
    max_tokens: Annotated[int, typer.Option(help="Most tokens generated per row")] = 256,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    top_k: Annotated[int, typer.Option(help="0 or -1 = off")] = 0,
    seed: Annotated[int | None, typer.Option(help="Per-request sampling seed")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable)")] = None,
    stop_token_ids: Annotated[
        list[str] | None,
        typer.Option(
            help="Token ids that end a row, besides EOS (comma-separated or repeated)", metavar="IDS"
        ),
    ] = None,
    min_p: Annotated[float, typer.Option(help="Drop tokens below min_p x the top token's probability")] = 0.0,
    min_tokens: Annotated[
        int, typer.Option(help="EOS and stop token ids count only after this many tokens")
    ] = 0,
    ignore_eos: Annotated[
        bool, typer.Option("--ignore-eos", help="Generate past EOS up to max_tokens")
    ] = False,
    n: Annotated[
        int,
        typer.Option(
            "--n",
            help="Completions per row (vLLM's n): all n in a 'choices' column, the first also in "
            "'output' (OpenAI batch output: the line's choices)",
        ),
    ] = 1,
    presence_penalty: Annotated[
        float, typer.Option(help="Subtracted from generated tokens' logits, [-2, 2]")
    ] = 0.0,
    frequency_penalty: Annotated[
        float, typer.Option(help="Subtracted per repeat of a generated token, [-2, 2]")
    ] = 0.0,
    repetition_penalty: Annotated[
        float, typer.Option(help="Divides logits of prompt and output tokens (HF/vLLM), 1 = off")
    ] = 1.0,
    logprobs: Annotated[
        int | None,
        typer.Option(
            help="Write each generated token's log probability and its K most likely alternatives "
            "(0-20, vLLM's logprobs) in a 'logprobs' column (OpenAI batch output: choices' logprobs)",
            metavar="K",
        ),
    ] = None,
    # --- scheduling ---
    policy: Annotated[str, typer.Option(help=opt.choices(POLICIES))] = "fcfs",
    window: Annotated[
        int, typer.Option(help="Look-ahead window in rows (the policy orders inside it)")
    ] = 1024,
    # --- engine (vLLM spellings; shared with `batchgen bench`) ---
    model: opt.Model = EngineConfig.model,
    dtype: opt.Dtype = EngineConfig.dtype,
    max_num_seqs: opt.MaxNumSeqs = EngineConfig.max_num_seqs,
    max_num_batched_tokens: opt.MaxNumBatchedTokens = EngineConfig.max_num_batched_tokens,
    block_size: opt.BlockSize = EngineConfig.block_size,
    max_model_len: opt.MaxModelLen = EngineConfig.max_model_len,
    gpu_memory_utilization: opt.GpuMemoryUtilization = EngineConfig.gpu_memory_utilization,
    kv_cache_memory: opt.KvCacheMemory = EngineConfig.kv_cache_memory,
    swap_space: opt.SwapSpace = EngineConfig.swap_space,
    enable_prefix_caching: opt.EnablePrefixCaching = EngineConfig.enable_prefix_caching,
    enable_chunked_prefill: opt.EnableChunkedPrefill = EngineConfig.enable_chunked_prefill,
    preemption_mode: opt.PreemptionMode = EngineConfig.preemption_mode,
    aging_steps: opt.AgingSteps = EngineConfig.aging_steps,
    attention_backend: opt.AttentionBackend = EngineConfig.attention_backend,
    kernels: opt.Kernels = EngineConfig.kernels,
    one_weight_layout: opt.OneWeightLayout = EngineConfig.one_weight_layout,
    device: opt.Device = EngineConfig.device,
    num_threads: opt.NumThreads = EngineConfig.num_threads,
    speculative_method: opt.SpeculativeMethod = EngineConfig.speculative_method,
    num_speculative_tokens: opt.NumSpeculativeTokens = EngineConfig.num_speculative_tokens,
    prompt_lookup_min: opt.PromptLookupMin = EngineConfig.prompt_lookup_min,
    prompt_lookup_max: opt.PromptLookupMax = EngineConfig.prompt_lookup_max,
    speculative_max_batch: opt.SpeculativeMaxBatch = EngineConfig.speculative_max_batch,
    # --- job mechanics ---
    no_dashboard: Annotated[
        bool, typer.Option("--no-dashboard", help="Plain progress lines instead of the live view")
    ] = False,
    commit_every: Annotated[int, typer.Option(help="Commit a part every this many finished rows")] = 1000,
    commit_interval: Annotated[float, typer.Option(help="...or every this many seconds")] = 10.0,
    progress_interval: Annotated[float, typer.Option(help="Seconds between plain progress lines")] = 5.0,
    # --- Prometheus metrics (the `batchgen[metrics]` extra) ---
    metrics_port: Annotated[
        int | None,
        typer.Option(min=0, max=65535, help="Serve Prometheus metrics at http://HOST:PORT/metrics"),
    ] = None,
    metrics_host: Annotated[
        str,
        typer.Option(
            help="Address --metrics-port listens on: 127.0.0.1 lets only this machine read the metrics; "
            "0.0.0.0 (your choice) lets any machine that reaches this one read them"
        ),
    ] = "127.0.0.1",
    metrics_file: Annotated[
        str | None,
        typer.Option(
            help="Also write the metrics to this file every few seconds, atomically (for node_exporter's "
            "textfile collector, which reads *.prom files)"
        ),
    ] = None,
    summary_json: Annotated[
        str | None,
        typer.Option(
            help="Also write the outcome as JSON to this file (rows, error rows, complete, exit code) "
            "for scripts; a job with some error rows exits 0, so read error_rows here",
            metavar="PATH",
        ),
    ] = None,
    # --- scale-out on Ray (pip install "batchgen[ray]") ---
    replicas: Annotated[
        int, typer.Option(min=1, help="Engine replicas; above 1 the job runs on Ray, one actor a replica")
    ] = 1,
    ray_address: Annotated[
        str | None,
        typer.Option(help="Run on this Ray cluster ('auto', HOST:PORT); default: a local Ray instance"),
    ] = None,
    gpus_per_replica: Annotated[float, typer.Option(help="GPUs each replica holds (Ray)")] = 0.0,
    cpus_per_replica: Annotated[
        float, typer.Option(help="CPUs each replica holds (Ray); its threads unless --num-threads")
    ] = 1.0,
) -> None:
    """Run a job file through the engine into an output file; rerun the same command to resume."""
    from batchgen.jobs.runner import JobOptions
    from batchgen.metrics import MetricsOptions

    engine = opt.engine_options(locals())
    # A name given twice is kept once (dict keys keep the first order).
    keep = tuple(
        dict.fromkeys(c.strip() for item in keep_columns or () for c in item.split(",") if c.strip())
    )
    resume_args = [a for a in sys.argv[1:] if a != "--overwrite"]
    options = JobOptions(
        input=input,
        output=output,
        overwrite=overwrite,
        strict=strict,
        prompt_column=prompt_column,
        messages_column=messages_column,
        id_column=id_column,
        template=template,
        system_prompt=system_prompt,
        chat_template=not no_chat_template,
        keep_columns=keep,
        limit=limit,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=tuple(stop or ()),
        stop_token_ids=_token_ids(stop_token_ids),
        min_p=min_p,
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
        n=n,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty,
        logprobs=logprobs,
        truncate_prompt=truncate_prompt,
        policy=policy,
        window=window,
        engine=engine,
        commit_rows=commit_every,
        commit_seconds=commit_interval,
        dashboard=not no_dashboard,
        progress_interval=progress_interval,
        resume_command="batchgen " + shlex.join(resume_args),
        metrics=MetricsOptions(port=metrics_port, host=metrics_host, file=metrics_file),
    )
    scale_out = None
    if replicas > 1 or ray_address is not None:
        from batchgen.distributed.pool import ReplicaOptions  # imports no Ray

        try:
            scale_out = ReplicaOptions(replicas, ray_address, cpus_per_replica, gpus_per_replica)
        except ValueError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
    action = _job_action.get()  # `batchgen plan` plans the rows wherever they would run
    if action is not None:
        action(options, summary_json)
    else:
        _run_and_exit(options, summary_json, scale_out)


# `batchgen plan` takes exactly `run`'s options: it calls `run_command` with this set to the plan.
_job_action: ContextVar[Callable[[JobOptions, str | None], None] | None] = ContextVar(
    "job_action", default=None
)


def plan_command(**values: Any) -> None:
    """Plan a job without running it: rows, error rows, prompt tokens, output budget, prefix-cache
    savings and KV-cache memory, from the job file and the model's tokenizer (no weights are loaded)."""
    as_json = values.pop("json_output")

    def plan(options: JobOptions, summary_json: str | None) -> None:
        from batchgen.jobs.plan import format_plan, plan_job
        from batchgen.jobs.reader import JobInputError

        try:
            result = plan_job(options, progress=True)
        except JobInputError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
        typer.echo(json.dumps(result.to_dict(), indent=2) if as_json else format_plan(result))

    token = _job_action.set(plan)
    try:
        run_command(**values)
    finally:
        _job_action.reset(token)


_run_signature = inspect.signature(run_command, eval_str=True)
_json_option = inspect.Parameter(
    "json_output",
    inspect.Parameter.KEYWORD_ONLY,
    default=False,
    annotation=Annotated[bool, typer.Option("--json", help="Print the plan as JSON")],
)
plan_command.__signature__ = _run_signature.replace(  # type: ignore[attr-defined]
    parameters=[*_run_signature.parameters.values(), _json_option]
)
plan_command.__annotations__ = {p.name: p.annotation for p in plan_command.__signature__.parameters.values()}
app.command("plan")(plan_command)


def _token_ids(values: list[str] | None) -> tuple[int, ...]:
    """`--stop-token-ids` values (each a comma list) as token ids.

    Raises:
        typer.BadParameter: a value that is not a whole number (a usage error, exit 2).
    """
    ids = []
    for item in values or ():
        for part in item.split(","):
            if not part.strip():
                continue
            try:
                ids.append(int(part))
            except ValueError:
                raise typer.BadParameter(
                    f"{part.strip()!r} is not a token id; give whole numbers, e.g. --stop-token-ids 2,13",
                    param_hint="--stop-token-ids",
                ) from None
    return tuple(ids)


def _run_and_exit(
    options: JobOptions, summary_json: str | None = None, scale_out: ReplicaOptions | None = None
) -> None:
    """`run_job` with the command's signal handling and exit codes. The process's handlers are
    restored on the way out, so an in-process caller (a test runner, say) does not inherit ignored
    signals, nor pass them on to the processes it starts; the `batchgen` command itself ignores
    them again until it exits (`batchgen.__main__.main`)."""
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    try:
        _run_with_stop_handlers(options, summary_json, scale_out)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _write_summary(path: str, summary: JobSummary, exit_code: int) -> None:
    """`--summary-json`: the run's outcome (`JobSummary.to_dict`) as JSON, written atomically. A
    failure to write it is reported, not raised: the job itself is done."""
    import json
    from pathlib import Path

    from batchgen.cache import write_atomically

    try:
        write_atomically(Path(path), (json.dumps(summary.to_dict(exit_code), indent=1) + "\n").encode())
    except OSError as e:
        typer.echo(f"error: --summary-json {path} could not be written: {e}", err=True)


def _exit_code(summary: JobSummary) -> int:
    """`batchgen run`'s exit code for a run that returned (see the module docstring)."""
    if summary.interrupted:  # the shell's convention: 128 + the signal (130 for Ctrl-C, 143 for SIGTERM)
        return 128 + (summary.stop_signal or signal.SIGINT)
    return 3 if summary.every_row_failed else 0


def _run_with_stop_handlers(
    options: JobOptions, summary_json: str | None = None, scale_out: ReplicaOptions | None = None
) -> None:
    from batchgen.jobs.reader import JobInputError
    from batchgen.jobs.runner import run_job

    last_signal = [signal.SIGINT]

    def stop_on_sigterm(signum: int, frame: object) -> None:
        # Outside the job loop (model loading, the final assembly) SIGTERM stops the run as Ctrl-C
        # does, instead of killing it without a word; inside it, `run_job` handles both itself.
        last_signal[0] = signum
        raise KeyboardInterrupt

    for s in STOP_SIGNALS:  # SIGINT keeps Python's KeyboardInterrupt, and its exit code 130
        if s != signal.SIGINT:
            signal.signal(s, stop_on_sigterm)
    try:
        if scale_out is None:
            summary = run_job(options)
        else:
            from batchgen.distributed import run_distributed

            summary = run_distributed(options, scale_out)
    except JobInputError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    except OSError as e:  # the disk, not the input: the output folder vanished, the disk filled up
        folder = os.path.dirname(e.filename) if isinstance(e.filename, str) else None
        if folder and not os.path.isdir(folder):  # the rows committed there went with it
            kept = (
                f"The folder {folder} is gone, and with it the rows committed there; fix the cause and rerun"
            )
        else:
            kept = "Rows committed before this are kept; fix the cause and resume"
        typer.echo(
            f"error: cannot write the job's output: {e}. {kept} with:\n  {options.resume_command}", err=True
        )
        raise typer.Exit(1) from None
    except KeyboardInterrupt:  # a second Ctrl-C, one during model loading, or SIGTERM: rows are kept
        typer.echo(
            f"interrupted; committed rows are kept. Resume with:\n  {options.resume_command}", err=True
        )
        raise typer.Exit(128 + last_signal[0]) from None
    # Everything is committed (or the run stopped cleanly): a Ctrl-C or SIGTERM from here to the end
    # of the process has nothing left to stop, and must not kill it with a KeyboardInterrupt traceback.
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    if summary_json is not None:
        _write_summary(summary_json, summary, _exit_code(summary))
    if summary.already_complete:
        errors = (
            f", {summary.rows_error} of its {summary.rows_done} rows are error rows"
            if summary.rows_error
            else ""
        )
        typer.echo(
            f"{summary.output_path} is already complete (same input and settings){errors}; --overwrite redoes it"
        )
    if summary.interrupted:
        raise typer.Exit(_exit_code(summary))
    if summary.every_row_failed:
        # A script that checks the exit code must not take an output of nothing but errors for a
        # finished job; the rows stay recorded, so a fixed command reruns with --overwrite.
        typer.echo(
            f"error: every one of the {summary.rows_error} rows failed; the first: {summary.first_error}\n"
            "The error rows are in the output. Fix the cause, then rerun with --overwrite",
            err=True,
        )
        raise typer.Exit(3)


app.command("tune")(tune_command)

# Imported at the top, unguarded: an import error in the bench is a bug to see, not a reason for
# `batchgen bench` to vanish from `--help` without a word.
app.command("bench")(bench_command)
