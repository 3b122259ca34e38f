"""`batchgen plan`'s weights line: the bytes of the weights under the quantization, estimated from the
config (`engine.weight_memory`), equal the bytes a loaded engine holds (its `Quantization.nbytes` and
its float parameters) but for the norms and biases, which the estimate leaves out."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from batchgen import LLM
from batchgen.engine.weight_memory import estimate_weights
from batchgen.jobs.runner import JobOptions
from batchgen.model.loading.loader import resolve_model
from batchgen.model.quantization import GGUF_LINEARS_NOTE, int8_linears
from batchgen.plan.job_plan import format_plan, plan_job
from tests.model.test_gguf_quantized import needs_kernels, quantized_gguf  # noqa: F401  (a fixture)

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def cache(tmp_path_factory, tokenizer_dir) -> Path:
    """batchgen's cache in a folder of this module's own: no quantized weights or GGUF notes from
    elsewhere (the tiny models' tokenizer, the default model, is resolved first, in the usual cache)."""
    path = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BATCHGEN_CACHE", str(path))
        yield path


def held_bytes(llm: LLM) -> tuple[int, int]:
    """(bytes of the weights a loaded engine holds as it runs them: its quantized linears'
    `Quantization.nbytes` and every other parameter, tied ones once; the norms' and biases' share
    of that, which the estimate leaves out). With kernels="reference" each quantized linear also
    keeps its dequantized float weight, for the reference: not counted, as the C kernels drop it."""
    runner = llm.llm_engine.runner
    quantized = {f"{name}.weight" for name in runner.quantization.weights}
    assert quantized <= {f"{name}.weight" for name in int8_linears(runner.model)}
    floats = [(n, p) for n, p in runner.model.named_parameters() if n not in quantized]
    left_out = sum(p.numel() * p.element_size() for n, p in floats if "norm" in n or n.endswith(".bias"))
    return runner.quantization.nbytes + sum(p.numel() * p.element_size() for _, p in floats), left_out


def _job(tmp_path: Path) -> Path:
    src = tmp_path / "job.jsonl"
    src.write_text("\n".join(json.dumps({"prompt": f"Question {i}?"}) for i in range(3)) + "\n")
    return src


@needs_kernels
@pytest.mark.parametrize("quantization", ["none", "int8", "auto"])
def test_the_weights_line_gives_the_bytes_a_loaded_engine_holds(
    tmp_path, tiny_model_dir, cache, quantization
):
    """A tiny random Llama (untied; a float checkpoint, so "auto" is "none"): the plan's figure is
    the loaded engine's bytes less its norms (5 x 64 float32 values), exactly."""
    model = str(tiny_model_dir("llama"))
    engine = {"model": model, "dtype": "float32", "device": "cpu", "quantization": quantization}
    plan = plan_job(JobOptions(str(_job(tmp_path)), max_tokens=4, engine=engine))
    llm = LLM(model, dtype="float32", device="cpu", quantization=quantization, kernels="reference")
    held, left_out = held_bytes(llm)
    assert left_out == 5 * 64 * 4  # two norms a layer and the final one
    assert plan.weight_bytes == held - left_out
    # 2 layers x (qkv 128x64 + o 64x64 + gate/up 256x64 + down 64x128), embedding and LM head 49152x64
    linears, embeddings = 2 * (128 * 64 + 64 * 64 + 256 * 64 + 64 * 128), 2 * 49152 * 64
    if quantization == "int8":  # int8 values and a float32 scale a channel and 16 inputs, the
        # LM head too; the embedding float
        assert plan.weight_bytes == (linears + embeddings / 2) * (1 + 4 / 16) + embeddings / 2 * 4
        assert llm.llm_engine.runner.quantization.nbytes == (linears + embeddings / 2) * (1 + 4 / 16)
    else:
        assert plan.weight_bytes == (linears + embeddings) * 4
    line = next(line for line in format_plan(plan).splitlines() if line.startswith("weights: "))
    shown = re.match(r"weights: (\d+\.\d) MiB as run \((\w+): ", line)
    assert shown is not None, line
    assert float(shown[1]) == round(plan.weight_bytes / 2**20, 1) and shown[2] == quantization
    if quantization == "int8":
        assert "8 of 8 decoder linears and the LM head 3.8 MiB in int8 (10.0 bits a weight" in line
        assert "the rest 12.0 MiB float32" in line
    else:
        assert "all 24.3 MiB float32; not counted: norms, biases" in line


@needs_kernels
def test_the_plan_command_gives_the_weights_in_its_json(tmp_path, tiny_model_dir, cache):
    """`batchgen plan --json` (torch kept out of its process: the estimate comes from the child)."""
    model = tiny_model_dir("qwen3")  # tied embeddings: the embedding counted once
    cmd = [sys.executable, "-m", "batchgen", "plan", str(_job(tmp_path)), "--model", str(model)]
    cmd += ["--quantization", "int8", "--dtype", "float32", "--no-calibrate", "--json"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    held, left_out = held_bytes(
        LLM(str(model), dtype="float32", device="cpu", quantization="int8", kernels="reference")
    )
    assert plan["weight_bytes"] == held - left_out
    assert plan["weights"].startswith("int8: 8 of 8 decoder linears and the LM head ")
    assert "; the LM head an int8 copy of the tied embedding;" in plan["weights"]


@needs_kernels
def test_a_gguf_files_quantized_linears_count_as_their_int8_weights(quantized_gguf, cache):  # noqa: F811
    """ "auto" on a GGUF file whose linears and LM head are Q4_1/Q5_0/Q8_0...: they count as the int8
    weights they run as (a byte a weight, a float32 scale a group of 32, an offset too where the
    type has a minimum), whether the file's tensor infos say so (no note yet) or the note a start
    left."""
    files = resolve_model(str(quantized_gguf))
    note = files.path / GGUF_LINEARS_NOTE
    note.unlink(missing_ok=True)
    from_file = estimate_weights(files.config, torch.float32, "auto", CPU, files.gguf, files.path)
    llm = LLM(str(quantized_gguf), dtype="float32", device="cpu", quantization="auto", kernels="reference")
    assert note.is_file()  # the start noted what the file holds
    from_note = estimate_weights(files.config, torch.float32, "auto", CPU, files.gguf, files.path)
    held, left_out = held_bytes(llm)
    assert from_file == from_note and from_file.total_bytes == held - left_out
    assert (from_file.format, from_file.quantized_linears, from_file.quantized_head) == ("int8", 8, True)
    # q/k/v, o and down hold offsets (Q4_1, Q5_1), gate/up does not (Q8_0, Q4_0); the head is Q8_0
    layer = (128 * 64 + 64 * 64 + 64 * 128) * (1 + 8 / 32) + 256 * 64 * (1 + 4 / 32)
    assert from_file.quantized_bytes == 2 * layer + 49152 * 64 * (1 + 4 / 32)
    none = estimate_weights(files.config, torch.float32, "none", CPU, files.gguf, files.path)
    assert none.quantized_bytes == 0


@pytest.mark.slow
@needs_kernels
def test_int8_estimate_of_the_default_model_is_its_loaded_bytes(default_model_files, monkeypatch):
    """SmolLM2-135M (tied embeddings, 30 layers) quantized to int8: the estimate is the loaded
    engine's bytes but its norms (61 x 576 values), within 0.1% of the whole."""
    from batchgen.model import quantization

    monkeypatch.setattr(quantization, "_cache_path", lambda *args: None)  # nothing written to the cache
    llm = LLM(None, dtype="float32", device="cpu", quantization="int8", kernels="reference")
    held, left_out = held_bytes(llm)
    files = default_model_files
    estimate = estimate_weights(files.config, torch.float32, "int8", CPU, files.gguf, files.path)
    assert left_out == 61 * 576 * 4
    assert estimate.total_bytes == held - left_out
    assert abs(estimate.total_bytes - held) / held < 1e-3
    assert estimate.quantized_linears == 30 * 4 and estimate.tied
