"""The `batchgen` command line (Typer). Thin: parses options and calls `batchgen.jobs.run_job`.

Exit codes of `batchgen run`: 0 done (error rows included: `--summary-json` gives their count), 3
done but every row of the job failed (the output holds the error rows), 2 bad input or options
(before any model work), 1 the output could not be written, 130 / 143 / 129 interrupted by SIGINT /
SIGTERM / SIGHUP (committed rows kept; the same command resumes).
"""

from __future__ import annotations

import copy
import inspect
import json
import sys
from typing import TYPE_CHECKING, Annotated, Any, get_args

import typer

from batchgen import cli_types as opt
from batchgen.bench.cli import bench_command
from batchgen.cli_run import check_summary_json, resume_command, run_and_exit, write_summary_json
from batchgen.config import POLICY_NAMES
from batchgen.sampling_params import SamplingDefaults
from batchgen.tune import tune_command

if TYPE_CHECKING:
    from batchgen.distributed.pool import ReplicaOptions
    from batchgen.jobs.options import JobOptions

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
def main(version: opt.Version = False) -> None:
    """batchgen: offline LLM batch inference with continuous batching over a paged KV cache."""


@app.command("run")
@opt.engine_flags()
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
            help="Output file (default: the input's path with its .parquet/.jsonl/.json/.ndjson suffix "
            "replaced by .out.parquet; .out.jsonl for OpenAI batch input)"
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
    chat_template_kwargs: Annotated[
        str | None,
        typer.Option(
            help="Extra chat template variables, a JSON object (vLLM's name), e.g. "
            "'{\"enable_thinking\": false}' for Qwen3; a row's own chat_template_kwargs wins key by key",
            metavar="JSON",
        ),
    ] = None,
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
    # --- sampling defaults (row columns override; declared in cli_types, defaults in SamplingDefaults) ---
    max_tokens: opt.MaxTokens = SamplingDefaults.max_tokens,
    temperature: opt.Temperature = SamplingDefaults.temperature,
    top_p: opt.TopP = SamplingDefaults.top_p,
    top_k: opt.TopK = SamplingDefaults.top_k,
    seed: opt.Seed = SamplingDefaults.seed,
    stop: opt.Stop = None,
    stop_token_ids: opt.StopTokenIds = None,
    min_p: opt.MinP = SamplingDefaults.min_p,
    min_tokens: opt.MinTokens = SamplingDefaults.min_tokens,
    ignore_eos: opt.IgnoreEos = SamplingDefaults.ignore_eos,
    n: opt.N = SamplingDefaults.n,
    presence_penalty: opt.PresencePenalty = SamplingDefaults.presence_penalty,
    frequency_penalty: opt.FrequencyPenalty = SamplingDefaults.frequency_penalty,
    repetition_penalty: opt.RepetitionPenalty = SamplingDefaults.repetition_penalty,
    logprobs: opt.Logprobs = SamplingDefaults.logprobs,
    prompt_logprobs: opt.PromptLogprobs = SamplingDefaults.prompt_logprobs,
    json_schema: opt.JsonSchema = None,
    regex: opt.Regex = None,
    choice: opt.Choice = None,
    grammar: opt.Grammar = None,
    # --- scheduling ---
    policy: Annotated[str, typer.Option(help=opt.choices(POLICY_NAMES))] = "fcfs",
    window: Annotated[
        int, typer.Option(help="Look-ahead window in rows (the policy orders inside it)")
    ] = 1024,
    # --- engine: EngineConfig's flags (vLLM spellings; shared with bench, tune and plan) ---
    engine: opt.EngineArgs = opt.ENGINE_FLAGS,
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
        typer.Option(
            help="Run on this Ray cluster ('auto', HOST:PORT; 'local': a Ray instance of this run even "
            "for one replica); default: a local Ray instance"
        ),
    ] = None,
    gpus_per_replica: Annotated[float, typer.Option(help="GPUs each replica holds (Ray)")] = 0.0,
    cpus_per_replica: Annotated[
        float, typer.Option(help="CPUs each replica holds (Ray); its threads unless --num-threads")
    ] = 1.0,
) -> None:
    """Run a job file through the engine into an output file; rerun the same command to resume."""
    check_summary_json(summary_json)
    options = _job_options(locals())
    scale_out = _scale_out(replicas, ray_address, cpus_per_replica, gpus_per_replica)
    run_and_exit(options, summary_json, scale_out)


def _job_options(values: dict[str, Any]) -> JobOptions:
    """`JobOptions` from `run_command`'s parameters (`locals()`; `engine`: the engine flags'
    values), the sampling options through their collector (`cli_types`), `--keep-columns` comma
    lists split, and the command that resumes this run (the same arguments without `--overwrite`)."""
    from batchgen.jobs.options import JobOptions
    from batchgen.metrics import MetricsOptions

    # A name given twice is kept once (dict keys keep the first order).
    keep = tuple(
        dict.fromkeys(
            c.strip() for item in values["keep_columns"] or () for c in item.split(",") if c.strip()
        )
    )
    return JobOptions(
        input=values["input"],
        output=values["output"],
        overwrite=values["overwrite"],
        strict=values["strict"],
        prompt_column=values["prompt_column"],
        messages_column=values["messages_column"],
        id_column=values["id_column"],
        template=values["template"],
        system_prompt=values["system_prompt"],
        chat_template=not values["no_chat_template"],
        chat_template_kwargs=_template_kwargs(values["chat_template_kwargs"]),
        keep_columns=keep,
        limit=values["limit"],
        truncate_prompt=values["truncate_prompt"],
        policy=values["policy"],
        window=values["window"],
        engine=values["engine"],
        commit_rows=values["commit_every"],
        commit_seconds=values["commit_interval"],
        dashboard=not values["no_dashboard"],
        progress_interval=values["progress_interval"],
        resume_command=resume_command(sys.argv[1:]),
        metrics=MetricsOptions(
            port=values["metrics_port"], host=values["metrics_host"], file=values["metrics_file"]
        ),
        **opt.sampling_options(values),
    )


def _template_kwargs(text: str | None) -> dict[str, Any] | None:
    """`--chat-template-kwargs` as a dict (None when not given).

    Raises:
        typer.BadParameter: not a JSON object (a usage error naming the flag, exit 2).
    """
    if text is None:
        return None
    from batchgen.jobs.input.row_chat import parse_chat_template_kwargs

    try:
        return parse_chat_template_kwargs(text)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def _scale_out(
    replicas: int, ray_address: str | None, cpus_per_replica: float, gpus_per_replica: float
) -> ReplicaOptions | None:
    """The Ray replicas a run asked for (`--replicas` above 1 or a `--ray-address`); None: this
    process runs the job. A bad value stops the command with exit 2."""
    if replicas <= 1 and ray_address is None:
        return None
    from batchgen.distributed.pool import ReplicaOptions  # imports no Ray

    try:
        return ReplicaOptions(replicas, ray_address, cpus_per_replica, gpus_per_replica)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def plan_command(**values: Any) -> None:
    """Plan a job without running it: rows, error rows, prompt tokens, output budget, prefix-cache
    savings and KV-cache memory from the job file and the model's tokenizer, and the estimated wall
    time from a few steps timed on this machine (the model is loaded for them on a CPU; cached).
    Takes a `run` command line as it is: the options that only change how a run reports, commits or
    where it runs (Ray) are accepted, and not listed here."""
    from batchgen.jobs.errors import JobInputError
    from batchgen.plan.job_plan import format_plan, plan_job
    from batchgen.plan.wall_time import WallTimeOptions

    as_json = values.pop("json_output")
    wall_time = WallTimeOptions(
        calibrate=values.pop("calibrate"),
        expected_output_tokens=values.pop("expected_output_tokens"),
        log=lambda line: typer.echo(line, err=True),
    )
    # `run`'s checks first, in its order: the plan is of the rows wherever they would run.
    summary_json = values["summary_json"]
    check_summary_json(summary_json)
    options = _job_options(values)
    _scale_out(
        values["replicas"], values["ray_address"], values["cpus_per_replica"], values["gpus_per_replica"]
    )
    try:
        result = plan_job(options, progress=True, wall_time=wall_time, torch_free=True)
    except JobInputError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(result.to_dict(), indent=2) if as_json else format_plan(result))
    if summary_json is not None:  # the plan, as --json prints it
        write_summary_json(summary_json, result.to_dict())
    if result.rows_error and not result.rows_valid and not result.rows_resumed:
        # `run` would end with exit 3 (every row failed): a script gets the same answer first.
        typer.echo(
            f"error: every one of the {result.rows_error} rows would fail; the first: "
            f"{result.first_errors[0]}",
            err=True,
        )
        raise typer.Exit(3)


# `plan` takes `run`'s parameters (its `engine` included: the same engine flags) and its own.
_run_signature = inspect.signature(inspect.unwrap(run_command), eval_str=True)
_plan_options = [
    inspect.Parameter(
        "json_output",
        inspect.Parameter.KEYWORD_ONLY,
        default=False,
        annotation=Annotated[bool, typer.Option("--json", help="Print the plan as JSON")],
    ),
    inspect.Parameter(
        "calibrate",
        inspect.Parameter.KEYWORD_ONLY,
        default=None,
        annotation=Annotated[
            bool | None,
            typer.Option(
                "--calibrate/--no-calibrate",
                help="Time a few steps of the model on this machine now for the wall-time estimate "
                "(--no-calibrate: only a cached calibration; default: a cached one, else measure on a "
                "CPU, not on CUDA, where it would load the GPU)",
                show_default=False,
            ),
        ],
    ),
    inspect.Parameter(
        "expected_output_tokens",
        inspect.Parameter.KEYWORD_ONLY,
        default=None,
        annotation=Annotated[
            int | None,
            typer.Option(
                min=1,
                help="Expected output tokens a sequence (the estimate's low end; default: what an "
                "earlier run's committed rows used, else a quarter of max_tokens)",
            ),
        ],
    ),
]
# `run`'s options that change nothing a plan says: how a run reports, commits and where it runs.
# `plan` accepts them (a run's command line plans as it is, with `run` changed to `plan`) but its
# --help does not list them.
_RUN_ONLY_OPTIONS = (
    "no_dashboard",
    "commit_every",
    "commit_interval",
    "progress_interval",
    "metrics_port",
    "metrics_host",
    "metrics_file",
    "replicas",
    "ray_address",
    "gpus_per_replica",
    "cpus_per_replica",
)


def _hidden(parameter: inspect.Parameter) -> inspect.Parameter:
    """`parameter` (an `Annotated[type, typer.Option(...)]`) with its option left out of --help."""
    base, info = get_args(parameter.annotation)
    info = copy.copy(info)
    info.hidden = True
    return parameter.replace(annotation=Annotated[base, info])


opt.set_signature(
    plan_command,
    _run_signature.replace(
        parameters=[
            *(_hidden(p) if p.name in _RUN_ONLY_OPTIONS else p for p in _run_signature.parameters.values()),
            *_plan_options,
        ]
    ),
)
app.command("plan")(opt.engine_flags()(plan_command))


app.command("tune")(tune_command)

# Imported at the top, unguarded: an import error in the bench is a bug to see, not a reason for
# `batchgen bench` to vanish from `--help` without a word.
app.command("bench")(bench_command)
