"""`batchgen plan`: what a job will cost before it runs, from its file and the model's tokenizer only.

The rows go through the same reader, sampling columns and error rules as `batchgen run`
(`prepare_row`, the engine's stop-token check), so the error rows and the prompt-token counts are
the ones `run` writes. No weights are loaded: the KV-cache size comes from the same sizing rules
as the engine's (`batchgen.engine.sizing`). Memory stays bounded: a row keeps two integers (its
prompt and output budget), and the prefix-cache estimate keeps at most the cache's blocks.
"""

from __future__ import annotations

import math
import os
from array import array
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

from batchgen.config import EngineConfig, resolve_device
from batchgen.jobs.manifest import MANIFEST, CommittedRows, PartEntry
from batchgen.jobs.options import JobOptions, default_output_path, output_format
from batchgen.jobs.reader import JobInputError
from batchgen.jobs.requests import prepare_row
from batchgen.jobs.resume import header_differences, parts_dir_for

FIRST_ERRORS = 5


def committed_rows(output: str, header: dict[str, Any]) -> tuple[CommittedRows | None, str | None]:
    """(rows an earlier run committed to `output`'s parts, a note when `run` would not resume them),
    read only: no lock is taken and a torn manifest line is skipped, not cut, so a live run is safe.

    Raises:
        JobInputError: a committed part cannot be read.
    """
    import json

    import numpy as np
    import pyarrow.parquet as pq

    parts_dir = parts_dir_for(output)
    path = os.path.join(parts_dir, MANIFEST)
    if not os.path.exists(path):
        done = os.path.exists(output)
        return None, (f"{output} exists: run reports it complete or refuses it" if done else None)
    with open(path, "rb") as f:
        data = f.read()
    lines = data[: data.rfind(b"\n") + 1].splitlines()
    try:
        old = json.loads(lines[0])["header"]
        entries = [PartEntry(**json.loads(line)) for line in lines[1:] if line.strip()]
    except (IndexError, KeyError, TypeError, ValueError):
        return None, f"{path} is damaged: run refuses it without --overwrite"
    if not entries:
        return None, None
    if diffs := header_differences(old, header):
        return None, (
            f"{output} has {sum(e.rows for e in entries)} rows committed by a run with other settings "
            f"({'; '.join(diffs)}): run refuses them without --overwrite; every row is planned"
        )
    idx, hashes = [], []
    for e in entries:
        try:
            t = pq.read_table(os.path.join(parts_dir, e.part), columns=["row_index", "row_hash"])
        except Exception as err:  # pyarrow raises several types for a missing or damaged file
            raise JobInputError(f"committed part {e.part} in {parts_dir} cannot be read ({err})") from err
        idx.append(t.column("row_index").to_numpy())
        hashes.append(t.column("row_hash").to_numpy())
    return CommittedRows(np.concatenate(idx).astype(np.int64), np.concatenate(hashes).astype(np.int64)), None


class TokenizerEngine:
    """What `prepare_row` needs of an engine (`tokenizer`, `encode_prompt`, `check_prompt_len`,
    `max_model_len`) and the KV-cache sizes, from the model's files without its weights: the sizes
    are `LLMEngine`'s own (`plan_engine`).

    Raises:
        ValueError: options the engine refuses too (`plan_engine`).
        ModelNotFoundError / UnsupportedModelError: from the loader.
    """

    def __init__(self, config: EngineConfig) -> None:
        import torch

        from batchgen.engine.sizing import plan_engine, resolve_dtype
        from batchgen.engine.tokenize import vocabulary_limit
        from batchgen.model.loading import loader

        device = torch.device(resolve_device(config.device))
        files = loader.resolve_model(config.model)
        self.model_files = files
        self.model_config = files.config
        self.tokenizer = loader.load_tokenizer(files)
        self.vocab_limit = vocabulary_limit(self.tokenizer, int(files.config.vocab_size))
        self.block_size = config.block_size
        self.plan = plan_engine(
            config, files.config, device, resolve_dtype(config.dtype, files.config, device)
        )
        self.max_model_len = self.plan.max_model_len
        self.num_blocks = self.plan.num_blocks
        self.bytes_per_block = self.plan.bytes_per_block

    @property
    def model_name(self) -> str | None:
        return self.model_files.name

    def check_prompt_len(self, num_tokens: int) -> str | None:
        return self.plan.check_prompt_len(num_tokens)

    def encode_prompt(self, prompt: Any) -> tuple[str | None, list[int]]:
        from batchgen.engine.tokenize import encode_prompt

        return encode_prompt(self.tokenizer, prompt, vocab_size=int(self.model_config.vocab_size))


@dataclass
class JobPlan:
    """What `plan` prints (`--json`: this as a dict). Token figures are over the rows that will run."""

    input: str
    model: str
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
    largest_row_tokens: int = 0  # prompt + output budget of the largest row
    largest_row_kv_bytes: int = 0
    max_num_seqs: int = 0
    typical_row_tokens: int = 0  # p50 prompt + mean output budget
    seqs_that_fit: int = 0  # typical rows the KV cache holds at once (at most max_num_seqs run)
    note: str | None = None  # about the rows an earlier run committed

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class _PrefixEstimate:
    """Prompt tokens a prefix cache of `capacity` blocks would serve, with rows in file order:
    full blocks are chained hashes (parent hash, the block's ids) in an LRU of that many blocks."""

    def __init__(self, block_size: int, capacity: int) -> None:
        self.block_size = block_size
        self.capacity = max(capacity, 1)
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.hit_tokens = 0

    def add(self, ids: list[int]) -> None:
        parent = 0
        bs = self.block_size
        # As the engine, the last prompt token is always computed: only blocks before it can hit.
        for start in range(0, len(ids) - 1 - (len(ids) - 1) % bs, bs):
            parent = hash((parent, tuple(ids[start : start + bs])))
            if parent in self.blocks:
                self.blocks.move_to_end(parent)
                self.hit_tokens += bs
                continue
            self.blocks[parent] = None
            if len(self.blocks) > self.capacity:
                self.blocks.popitem(last=False)


def plan_job(options: JobOptions, engine: Any = None, progress: bool = False) -> JobPlan:
    """Read the job (streaming) and tokenize every row as `run` would; nothing is written.

    Args:
        options: the job, as `batchgen run` takes it.
        engine: anything with TokenizerEngine's attributes (default: a TokenizerEngine).
        progress: a progress bar on stderr while rows are tokenized (only on a terminal).

    Raises:
        JobInputError: the input, its schema, the options or the model cannot be used.
    """
    import numpy as np

    from batchgen.jobs.runner import check_run_options, job_header, job_reader

    config = check_run_options(options)
    reader = job_reader(options)
    output = options.output or default_output_path(options.input, reader.format)
    fmt = output_format(output, reader.format)
    committed, note = (
        (None, None) if options.overwrite else committed_rows(output, job_header(options, reader, fmt))
    )
    if engine is None:
        from batchgen.model.loading.architectures import ModelNotFoundError

        try:
            engine = TokenizerEngine(config)
        except (ModelNotFoundError, ValueError) as e:
            raise JobInputError(f"cannot plan for model {config.model or '(default)'}: {e}") from e
    tokenizer = engine.tokenizer
    chat = options.chat_template and bool(getattr(tokenizer, "chat_template", None))
    bos = getattr(tokenizer, "bos_token_id", None)
    max_len = engine.max_model_len
    plan = JobPlan(reader.source, engine.model_name or str(config.model or "default"), note=note)
    prompts, budgets = array("l"), array("l")
    prefix = _PrefixEstimate(engine.block_size, engine.num_blocks) if config.enable_prefix_caching else None

    def error(message: str) -> None:
        plan.rows_error += 1
        if len(plan.first_errors) < FIRST_ERRORS:
            plan.first_errors.append(message)

    rows: Any = reader
    if progress:
        from tqdm import tqdm

        rows = tqdm(
            reader, total=reader.count_rows(), unit=" rows", desc="tokenizing", disable=None, leave=False
        )
    for row in rows:
        plan.rows = row.row_index + 1
        if committed is not None and committed.is_committed(row.row_index, row.row_hash, row.where):
            plan.rows_resumed += 1
            continue
        if row.error is not None:
            error(row.error)
            continue
        prepared, message = prepare_row(row, engine, options, chat, bos, max_len)
        if message is not None:
            plan.rows_too_long += prepared is not None
            error(message)
            continue
        sp = row.sampling_params
        unknown = [t for t in sp.stop_token_ids or () if t >= engine.vocab_limit]
        if unknown:  # the engine's own check (LLMEngine._add_one)
            error(
                f"stop_token_ids holds ids outside the vocabulary [0, {engine.vocab_limit}): {unknown[:5]}; "
                "fix or remove them"
            )
            continue
        n = prepared.prompt_tokens
        room = max_len - n
        prompts.append(n)
        budgets.append(sp.n * (room if sp.max_tokens is None else min(sp.max_tokens, room)))
        if prefix is not None:
            prefix.add(prepared.token_ids)
    plan.rows_valid = len(prompts)
    plan.max_model_len = max_len
    plan.block_size = engine.block_size
    plan.kv_cache_tokens = engine.num_blocks * engine.block_size
    plan.kv_bytes_per_token = engine.bytes_per_block // engine.block_size
    plan.max_num_seqs = config.max_num_seqs
    if prompts:
        p, b = np.array(prompts, dtype=np.int64), np.array(budgets, dtype=np.int64)
        plan.prompt_tokens = int(p.sum())
        plan.prompt_tokens_p50 = int(np.percentile(p, 50, method="nearest"))
        plan.prompt_tokens_p99 = int(np.percentile(p, 99, method="nearest"))
        plan.prompt_tokens_max = int(p.max())
        plan.max_output_tokens = int(b.sum())
        plan.largest_row_tokens = int((p + b).max())
        plan.largest_row_kv_bytes = (
            _blocks(plan.largest_row_tokens, engine.block_size) * engine.bytes_per_block
        )
        plan.typical_row_tokens = plan.prompt_tokens_p50 + math.ceil(float(b.mean()))
        per_row = _blocks(plan.typical_row_tokens, engine.block_size)
        plan.seqs_that_fit = min(engine.num_blocks // max(per_row, 1), config.max_num_seqs)
    plan.prefix_caching = prefix is not None
    if prefix is not None:
        plan.prefix_cache_tokens = prefix.hit_tokens
    return plan


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def format_plan(plan: JobPlan) -> str:
    """The plan as the lines `batchgen plan` prints."""
    resumed = f"{plan.rows_resumed} committed by an earlier run; of the rest " if plan.rows_resumed else ""
    saved = 100 * plan.prefix_cache_tokens / plan.prompt_tokens if plan.prompt_tokens else 0.0
    lines = [
        f"job: {plan.input} (model {plan.model})",
        f"rows: {plan.rows} ({resumed}{plan.rows_valid} valid, {plan.rows_error} error rows, "
        f"{plan.rows_too_long} of them too long for max_model_len {plan.max_model_len})",
        f"prompt tokens: {plan.prompt_tokens} (p50 {plan.prompt_tokens_p50}, p99 {plan.prompt_tokens_p99}, "
        f"max {plan.prompt_tokens_max})",
        f"output budget: {plan.max_output_tokens} tokens (each row's max_tokens, capped by max_model_len)",
        f"prefix cache: about {plan.prefix_cache_tokens} prompt tokens ({saved:.0f}%) served from shared "
        f"prefixes of {plan.block_size}-token blocks"
        if plan.prefix_caching
        else "prefix cache: off (--no-enable-prefix-caching)",
        f"KV cache: {plan.kv_cache_tokens} tokens at {plan.kv_bytes_per_token} bytes a token; the largest row "
        f"needs {plan.largest_row_tokens} tokens ({_mib(plan.largest_row_kv_bytes)}); "
        f"{plan.seqs_that_fit} typical rows ({plan.typical_row_tokens} tokens) fit at once, "
        f"max_num_seqs {plan.max_num_seqs}",
    ]
    if plan.note:
        lines.append(f"note: {plan.note}")
    if plan.first_errors:
        lines.append(f"first error rows ({len(plan.first_errors)} of {plan.rows_error}):")
        lines += [f"  {e}" for e in plan.first_errors]
    return "\n".join(lines)
