"""`file:PATH` bench workloads: a job file's prompts, with output lengths from each row's `max_tokens`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from batchgen.bench.workloads import (
    BenchRequest,
    PromptEncoder,
    Workload,
    WorkloadSpec,
    arrival_params,
    arrival_times,
    clip_lengths,
)


def read_job_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSONL (`.jsonl`, `.json`) or Parquet (`.parquet`) job file as dicts.

    Raises:
        FileNotFoundError: when the file is absent.
        ValueError: naming the line of a JSONL record that is not a JSON object.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"job file {path} not found")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON ({exc.msg})") from exc
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def _row_prompt_and_max_tokens(row: dict[str, Any]) -> tuple[Any, int | None]:
    body = row.get("body") if isinstance(row.get("body"), dict) else {}
    sp = row.get("sampling_params") if isinstance(row.get("sampling_params"), dict) else {}
    if row.get("prompt_token_ids") is not None:
        prompt: Any = {"prompt_token_ids": list(row["prompt_token_ids"])}
    elif row.get("messages") is not None:
        prompt = list(row["messages"])
    elif row.get("prompt") is not None:
        prompt = row["prompt"]
    elif body.get("messages") is not None:
        prompt = list(body["messages"])
    elif body.get("prompt") is not None:
        prompt = body["prompt"]
    else:
        raise ValueError("row has no prompt, messages, prompt_token_ids or body.messages")
    for value in (
        row.get("max_tokens"),
        sp.get("max_tokens"),
        body.get("max_tokens"),
        body.get("max_completion_tokens"),
    ):
        if value is not None:
            return prompt, int(value)
    return prompt, None


def file_workload(spec: WorkloadSpec, encode: PromptEncoder, max_model_len: int) -> Workload:
    """The first `spec.num_prompts` rows (0 = all) of the job file `spec.dist[5:]` as a workload.

    Prompts are tokenized by `encode` (rows with `prompt_token_ids` are taken as they are); a row
    without `max_tokens` runs `spec.output_len` tokens. Lengths are clipped to `max_model_len`.

    Raises:
        FileNotFoundError: the file is absent.
        ValueError: naming the row that has no prompt or an empty one.
    """
    path = Path(spec.dist[5:])
    rows = read_job_rows(path)
    if spec.num_prompts:
        rows = rows[: spec.num_prompts]
    prompts: list[list[int]] = []
    outs: list[int] = []
    for i, row in enumerate(rows):
        try:
            prompt, max_tokens = _row_prompt_and_max_tokens(row)
            ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else encode(prompt)
            if not ids:
                raise ValueError("empty prompt")
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"{path}: row {i}: {exc}") from exc
        prompts.append(list(ids))
        outs.append(max_tokens if max_tokens is not None else spec.output_len)
    inputs, outputs, clipped = clip_lengths(
        np.asarray([len(p) for p in prompts], dtype=np.float64),
        np.asarray(outs, dtype=np.float64),
        max_model_len,
    )
    arrivals = arrival_times(spec, len(prompts))
    requests = [
        BenchRequest(str(i), p[: int(k)], int(o), float(a))
        for i, (p, k, o, a) in enumerate(zip(prompts, inputs, outputs, arrivals, strict=True))
    ]
    params = {
        "dist": "file",
        "path": str(path),
        "num_prompts": len(requests),
        "default_output_len": spec.output_len,
        "max_model_len": max_model_len,
        "num_clipped": clipped,
    } | arrival_params(spec)
    return Workload(f"file:{path.name}", requests, params)
