"""What `batchgen plan` reads besides the job file: an earlier run's committed rows (read only) and the
model's tokenizer and KV-cache sizes (no weights)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from batchgen.config import EngineConfig
from batchgen.jobs.errors import JobInputError
from batchgen.jobs.output.header import header_differences
from batchgen.jobs.output.manifest import MANIFEST, CommittedRows, PartEntry
from batchgen.jobs.output.resume import parts_dir_for


class CommittedOutputs:
    """The prompt and completion tokens of the rows an earlier run committed without an error:
    sorted `int64` arrays, looked up by row index (for the output lengths they measured)."""

    def __init__(self, row_index: np.ndarray, prompt_tokens: np.ndarray, completion_tokens: np.ndarray):
        order = np.argsort(row_index, kind="stable")
        self.row_index = row_index[order]
        self.prompt_tokens = prompt_tokens[order]
        self.completion_tokens = completion_tokens[order]

    def lookup(self, row_index: int) -> tuple[int, int] | None:
        """(prompt tokens, completion tokens) of a committed row that ran, or None."""
        i = int(np.searchsorted(self.row_index, row_index))
        if i < len(self.row_index) and self.row_index[i] == row_index:
            return int(self.prompt_tokens[i]), int(self.completion_tokens[i])
        return None


def _read_parts(parts_dir: str, entries: list[PartEntry]) -> tuple[CommittedRows, CommittedOutputs]:
    import pyarrow.parquet as pq

    columns = ["row_index", "row_hash", "prompt_tokens", "completion_tokens", "finish_reason"]
    got: dict[str, list[np.ndarray]] = {c: [] for c in columns}
    for e in entries:
        try:
            t = pq.read_table(os.path.join(parts_dir, e.part), columns=columns)
        except Exception as err:  # pyarrow raises several types for a missing or damaged file
            raise JobInputError(f"committed part {e.part} in {parts_dir} cannot be read ({err})") from err
        for c in columns:
            got[c].append(t.column(c).to_numpy(zero_copy_only=False))
    a = {c: np.concatenate(v) for c, v in got.items()}
    ran = a["finish_reason"] != "error"
    ints = {c: np.nan_to_num(a[c].astype(np.float64)).astype(np.int64) for c in columns[2:4]}
    return (
        CommittedRows(a["row_index"].astype(np.int64), a["row_hash"].astype(np.int64)),
        CommittedOutputs(
            a["row_index"].astype(np.int64)[ran], ints["prompt_tokens"][ran], ints["completion_tokens"][ran]
        ),
    )


def committed_rows(
    output: str, header: dict[str, Any]
) -> tuple[CommittedRows | None, CommittedOutputs | None, str | None]:
    """(rows an earlier run committed to `output`'s parts, the lengths of those that ran, a note
    when `run` would not resume them), read only: no lock is taken and a torn manifest line is
    skipped, not cut, so a live run is safe.

    Raises:
        JobInputError: a committed part cannot be read.
    """
    parts_dir = parts_dir_for(output)
    path = os.path.join(parts_dir, MANIFEST)
    if not os.path.exists(path):
        done = os.path.exists(output)
        return None, None, (f"{output} exists: run reports it complete or refuses it" if done else None)
    with open(path, "rb") as f:
        data = f.read()
    lines = data[: data.rfind(b"\n") + 1].splitlines()
    try:
        old = json.loads(lines[0])["header"]
        entries = [PartEntry(**json.loads(line)) for line in lines[1:] if line.strip()]
    except (IndexError, KeyError, TypeError, ValueError):
        return None, None, f"{path} is damaged: run refuses it without --overwrite"
    if not entries:
        return None, None, None
    if diffs := header_differences(old, header):
        return (
            None,
            None,
            (
                f"{output} has {sum(e.rows for e in entries)} rows committed by a run with other settings "
                f"({'; '.join(diffs)}): run refuses them without --overwrite; every row is planned"
            ),
        )
    return (*_read_parts(parts_dir, entries), None)


class TokenizerEngine:
    """What `prepare_row` needs of an engine (`tokenizer`, `encode_prompt`, `check_prompt_len`,
    `max_model_len`) and the KV-cache sizes, from the model's files without its weights: the sizes
    are `LLMEngine`'s own (`plan_engine`).

    Args:
        config: the job's engine options.
        torch_free: keep torch out of this process where it is not imported yet
            (`batchgen.plan.child`): the sizes and any calibration come from a child process.
            Only for a process that ends after the plan: torch stays unimportable in it.

    Attributes:
        device: "cpu" or "cuda"; dtype: the compute dtype's name ("bfloat16"); plan: the
            `EnginePlan`; model_dir: the model's folder (a GGUF file's converted copy); weights:
            the weights' bytes under the quantization (`WeightEstimate`).

    Raises:
        JobInputError: the device cannot be used (torch_free only: else `check_run_options` says so).
        ValueError: the model cannot be found or used, or options the engine refuses too.
    """

    def __init__(self, config: EngineConfig, torch_free: bool = False) -> None:
        from batchgen.engine.engine_plan import EnginePlan, WeightEstimate
        from batchgen.engine.tokenize import vocabulary_limit
        from batchgen.model.loading import loader
        from batchgen.plan import child as plan_child

        self.isolated = torch_free and plan_child.can_hide_torch()
        try:
            if self.isolated:  # the child first: it peaks while this process is at its smallest
                facts = plan_child.ask_child("sizes", config)
                plan_child.hide_torch()
            else:
                facts = plan_child.sizes(config)
        except plan_child.ChildError as e:
            if e.kind == "options":
                raise JobInputError(str(e)) from e
            raise ValueError(str(e)) from e
        self.device: str = facts["device"]
        self.dtype: str = facts["dtype"]
        self.model_dir = Path(facts["model_dir"])
        self.model_name: str | None = facts["model_name"]
        self.vocab_size: int = facts["vocab_size"]
        self.kernels_cached: bool = facts.get("kernels_cached", True)
        self.weights = WeightEstimate.from_json(facts["weights"])
        self.tokenizer = loader.load_tokenizer(self.model_dir)
        self.vocab_limit = vocabulary_limit(self.tokenizer, self.vocab_size)
        self.block_size = config.block_size
        self.plan = EnginePlan(**facts["plan"])
        self.max_model_len = self.plan.max_model_len
        self.max_num_batched_tokens = self.plan.max_num_batched_tokens
        self.num_blocks = self.plan.num_blocks
        self.num_swap_blocks = self.plan.num_swap_blocks
        self.bytes_per_block = self.plan.bytes_per_block

    def measure(
        self, config: EngineConfig, dtype: str, device: str, lengths: dict[str, int], options: Any
    ) -> tuple[Any, tuple[float, int] | None]:
        """`wall_time.measure_machine`, in a child process when this one keeps torch out.

        Raises:
            ValueError / ModelNotFoundError: the calibration's engine cannot be built.
        """
        from batchgen.plan import child as plan_child

        if self.isolated:
            return plan_child.ask_measure(config, dtype, device, lengths, options)
        import torch

        from batchgen.plan.wall_time import measure_machine

        return measure_machine(config, getattr(torch, dtype), device, lengths, options)

    def compile_grammars(
        self, config: EngineConfig, constraints: list[dict]
    ) -> list[tuple[str | None, float]]:
        """Each structured outputs constraint compiled as the engine would (`plan.grammars`): (the
        error or None, compile seconds) each; in the child when this process keeps torch out.

        Raises:
            ValueError: the child could not do it (its message)."""
        from batchgen.plan import child as plan_child
        from batchgen.plan.grammars import in_this_process

        if not self.isolated:
            return in_this_process(config, constraints)
        try:
            answer = plan_child.ask_child("grammars", config, constraints=constraints)
        except plan_child.ChildError as e:
            raise ValueError(str(e)) from e
        return [(error, seconds) for error, seconds in answer["results"]]

    def check_prompt_len(self, num_tokens: int) -> str | None:
        return self.plan.check_prompt_len(num_tokens)

    def encode_prompt(self, prompt: Any) -> tuple[str | None, list[int]]:
        from batchgen.engine.tokenize import encode_prompt

        return encode_prompt(self.tokenizer, prompt, vocab_size=self.vocab_size)
