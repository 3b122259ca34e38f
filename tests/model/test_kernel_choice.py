"""`--kernels auto` on a loaded model: measured, correct, cached, and honest about what it runs.

The registry itself (`kernels.registry.choose`) is tested in tests/kernels/test_registry.py; these
tests run whole engines on the tiny random-weight models, in float32, against `--kernels reference`
(plain torch) and Hugging Face.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from batchgen import LLM, SamplingParams
from batchgen.kernels import registry
from batchgen.kernels.cpu import library as cpu_kernels
from batchgen.kernels.cpu import linear as cpu_linear
from batchgen.kernels.cpu.linear import WEIGHT_LAYOUTS, PlainLinear, TunedLinear
from batchgen.model.kernel_choice import choice as kernel_choice
from batchgen.model.kernel_choice import linear as linear_choice

PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40, 90)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def fresh_tuning_cache(tmp_path, monkeypatch):
    """Each test measures on its own (an empty tuning cache under tmp_path)."""
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "cache"))


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def reference_tokens(tiny_model_dir) -> list[list[int]]:
    llm = LLM(
        str(tiny_model_dir("llama")), dtype="float32", max_num_seqs=4, device="cpu", kernels="reference"
    )
    return _tokens(llm)


class _Slow(PlainLinear):
    """Right answer, 3 ms late: must never be chosen."""

    def forward(self, x):
        time.sleep(0.003)
        return super().forward(x)


class _Wrong(PlainLinear):
    """Fast and wrong (a zero output): must be dropped."""

    def forward(self, x):
        return torch.zeros(*x.shape[:-1], self.out_features, dtype=x.dtype)


def test_a_slow_candidate_is_never_chosen_and_a_wrong_one_is_dropped(
    tiny_model_dir, reference_tokens, monkeypatch, caplog
):
    real = cpu_linear.linear_candidates

    def with_bad_ones(weight, bias):
        builders = real(weight, bias)
        builders["slow"] = lambda: _Slow(weight.detach(), bias)
        builders["wrong"] = lambda: _Wrong(weight.detach(), bias)
        return builders

    monkeypatch.setattr(linear_choice, "linear_candidates", with_bad_ones)  # what is timed and built
    with caplog.at_level("WARNING", logger="batchgen.kernels.registry"):
        llm = LLM(str(tiny_model_dir("llama")), dtype="float32", max_num_seqs=4, device="cpu", kernels="auto")
    choice = llm.llm_engine.runner.kernel_choice
    used = {name for by_bucket in choice.linears.values() for name in by_bucket}
    assert used and not used & {"slow", "wrong"}
    modules = list(llm.llm_engine.runner.model.modules())
    assert not any(isinstance(m, (_Slow, _Wrong)) for m in modules)
    entries = [entry for key, entry in choice.table.entries.items() if key.startswith("linear|")]
    assert entries and all(entry["ms"]["wrong"] is None for entry in entries)  # never timed
    assert all("wrong" in entry["dropped"] and "slow" not in entry["dropped"] for entry in entries)
    # One warning line per linear shape for the wrong candidate (at its first bucket), not one per bucket.
    warnings = [r for r in caplog.records if "kernel wrong" in r.getMessage()]
    assert 1 <= len(warnings) <= len(choice.linears)
    assert _tokens(llm) == reference_tokens


def test_a_second_start_measures_nothing(tiny_model_dir, reference_tokens, monkeypatch):
    path = str(tiny_model_dir("llama"))
    threads = torch.get_num_threads()  # fixed: the table is per thread count, which a busy machine changes
    first = LLM(path, dtype="float32", max_num_seqs=4, device="cpu", kernels="auto", num_threads=threads)
    assert first.llm_engine.runner.kernel_choice.table.entries
    del first

    def no_timing(*args, **kwargs):
        raise AssertionError("a second start must take its choice from the cached table")

    monkeypatch.setattr(registry, "fastest_seconds", no_timing)
    second = LLM(path, dtype="float32", max_num_seqs=4, device="cpu", kernels="auto", num_threads=threads)
    choice = second.llm_engine.runner.kernel_choice
    assert choice.seconds < 1.0
    assert _tokens(second) == reference_tokens


@pytest.mark.skipif(cpu_kernels.load_library() is None, reason="no C compiler to build the CPU kernels")
def test_prefill_chunks_on_torch_sdpa_give_the_reference_tokens(
    tiny_model_dir, reference_tokens, monkeypatch
):
    """Where the measurement sends long prefill chunks to torch's SDPA, the tokens stay the reference's."""
    monkeypatch.setattr(kernel_choice, "tune_prefill_attention", lambda *a, **k: ["c"] * 4 + ["sdpa"] * 8)
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", max_num_seqs=4, device="cpu", kernels="auto")
    backend = llm.llm_engine.runner.backend
    assert backend.name == "cpu" and backend.prefill_by_bucket[-1] == "sdpa"
    assert backend.prefill_after_prefix_by_bucket[-1] == "sdpa"
    assert "prefill attention c 1-8, sdpa 16-2048 rows" in llm.llm_engine.runner.kernel_choice.summary()
    assert _tokens(llm) == reference_tokens


def test_tuned_linear_runs_the_implementation_of_each_row_bucket():
    """A 3-row call runs the 4-row bucket's implementation, a 5-row one the 8-row bucket's, and calls
    past the last bucket its implementation."""
    weight = torch.randn(32, 16)
    calls = []

    class Tagged(PlainLinear):
        def __init__(self, tag):
            super().__init__(weight, None)
            self.tag = tag

        def forward(self, x):
            calls.append(self.tag)
            return super().forward(x)

    tuned = TunedLinear({"a": Tagged("a"), "b": Tagged("b")}, ["a", "a", "a", "b"])  # buckets 1, 2, 4, 8
    for rows in (1, 3, 4, 5, 8, 100):
        out = tuned(torch.randn(rows, 16))
        torch.testing.assert_close(out, nn.functional.linear(torch.zeros(rows, 16), weight) + out)
    assert calls == ["a", "a", "a", "b", "b", "b"]
    assert [tuned.kind_at(r) for r in (1, 3, 4, 5, 8, 100)] == calls


_EMULATED_RUN = """
import json, sys
from batchgen import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", max_num_seqs=4, device="cpu", kernels="auto")
prompts = [{"prompt_token_ids": ids} for ids in json.loads(sys.argv[2])]
params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
choice = llm.llm_engine.runner.kernel_choice
print(json.dumps({
    "tokens": [o.outputs[0].token_ids for o in llm.generate(prompts, params)],
    "linears": choice.linears,
    "table": str(choice.table.path),
}))
"""


@pytest.mark.parametrize("isa", ["AVX512_CORE_BF16", "AVX2"])
def test_emulated_lesser_cpus_match_hugging_face(tiny_model_dir, tmp_path, isa):
    """`ONEDNN_MAX_CPU_ISA` (oneDNN's own switch) emulates a CPU without AMX or without AVX-512: the
    engine chooses its kernels again under its own table and stays token-identical to transformers."""
    from tests.engine.test_fidelity import hf_greedy

    path = tiny_model_dir("llama")
    prompt_ids = [p["prompt_token_ids"] for p in PROMPTS]
    env = {**os.environ, "BATCHGEN_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    runs = {}
    for cap in (None, isa):
        run_env = {k: v for k, v in env.items() if k not in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")}
        if cap:
            run_env["ONEDNN_MAX_CPU_ISA"] = cap
        result = subprocess.run(
            [sys.executable, "-c", _EMULATED_RUN, str(path), json.dumps(prompt_ids)],
            capture_output=True,
            text=True,
            timeout=600,
            env=run_env,
            cwd=tmp_path,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        runs[cap] = json.loads(result.stdout.strip().splitlines()[-1])
    expected = hf_greedy(path, prompt_ids, GREEDY.max_tokens, ignore_eos=True)
    assert runs[isa]["tokens"] == expected
    assert runs[None]["tokens"] == expected
    assert runs[isa]["table"] != runs[None]["table"]  # another machine key: measured again, not reused


NEEDS_BF16_KERNEL = pytest.mark.skipif(
    not cpu_linear.bf16_kernel_available() or not cpu_linear.can_prepack(torch.bfloat16, torch.device("cpu")),
    reason="the C decoder stack needs batchgen's bf16 linear kernel (AVX512-BF16) and oneDNN bf16",
)


def _held_layouts_match_the_choice(llm: LLM) -> None:
    """Each tuned linear holds the layouts its buckets run, plus the stack's where the stack runs;
    the reported extra bytes are those layouts."""
    runner = llm.llm_engine.runner
    choice, model = runner.kernel_choice, runner.model
    stack_runs = model.decoder_stack is not None
    extra = 0
    for name, module in model.named_modules():
        if isinstance(module, TunedLinear):
            in_layers = name.startswith("model.layers.")
            runs = set(module.by_bucket)
            if stack_runs and in_layers and not runs & {"bf16_c", "amx_c"}:
                runs.add("bf16_c")  # the stack's packed layout
            assert set(module.impls) == runs
            # batchgen's two C kernels share one packed copy of the weight
            layouts = {WEIGHT_LAYOUTS[kind] for kind in module.impls}
            if {"bf16_c", "amx_c"} <= set(module.impls):
                assert module.impls["bf16_c"].packed_weight is module.impls["amx_c"].packed_weight
            extra += (len(layouts) - 1) * module.in_features * module.out_features * 2
    assert choice.extra_weight_bytes == extra
    assert (choice.stack_max_rows is None) == (not stack_runs)


@NEEDS_BF16_KERNEL
def test_the_stack_runs_where_measured_faster_and_holds_its_layout_only_then(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), dtype="bfloat16", max_num_seqs=8, device="cpu", kernels="auto")
    choice = llm.llm_engine.runner.kernel_choice
    entries = {k: e for k, e in choice.table.entries.items() if k.startswith("decoder_stack|")}
    assert len(entries) == 4  # row buckets 1, 2, 4, 8 (max_num_seqs)
    chosen_at = {int(key.rsplit("|", 1)[1]): entry["chosen"] for key, entry in entries.items()}
    expected = 0
    for rows in sorted(chosen_at):
        if chosen_at[rows] not in ("stack", "stack_amx"):
            break
        expected = rows
    assert (choice.stack_max_rows or 0) == expected
    linears = {"stack": "bf16_c", "stack_amx": "amx_c"}
    assert choice.stack_linears == [
        linears[chosen_at[rows]] for rows in sorted(chosen_at) if rows <= expected
    ]
    _held_layouts_match_the_choice(llm)


@NEEDS_BF16_KERNEL
def test_a_stack_that_computes_wrong_is_dropped(tiny_model_dir, monkeypatch, caplog):
    from batchgen.kernels.cpu.stack import DecoderStack

    real_call = DecoderStack.__call__

    def wrong(self, hidden, cos_sin, kv_caches, meta):
        return real_call(self, hidden, cos_sin, kv_caches, meta) * 3

    monkeypatch.setattr(DecoderStack, "__call__", wrong)
    with caplog.at_level("WARNING", logger="batchgen.kernels.registry"):
        llm = LLM(
            str(tiny_model_dir("llama")), dtype="bfloat16", max_num_seqs=8, device="cpu", kernels="auto"
        )
    assert llm.llm_engine.runner.model.decoder_stack is None
    assert llm.llm_engine.runner.kernel_choice.stack_max_rows is None
    assert any("kernel stack for decoder_stack" in r.getMessage() for r in caplog.records)
    _held_layouts_match_the_choice(llm)


@pytest.mark.skipif(cpu_kernels.load_library() is None, reason="no C compiler to build the CPU kernels")
def test_decodes_on_the_torch_path_give_the_reference_tokens(tiny_model_dir, reference_tokens, monkeypatch):
    """Where the measurement sends bigger decode batches to the torch path, the tokens stay the reference's."""
    monkeypatch.setattr(kernel_choice, "tune_decode_attention", lambda *a, **k: ["c", "torch", "torch"])
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", max_num_seqs=4, device="cpu", kernels="auto")
    backend = llm.llm_engine.runner.backend
    assert backend.decode_by_bucket == ["c", "torch", "torch"]
    assert "decode attention torch from 2 sequences" in llm.llm_engine.runner.kernel_choice.summary()
    assert _tokens(llm) == reference_tokens


def test_the_table_rate_sums_each_layer_linear_at_its_chosen_candidate_and_the_largest_bucket():
    """Two 8x4 linears and one 4x8 at 64 rows (the largest bucket up to 50 rows): 3 x 4,096 FLOPs
    over 2 x 1 ms + 2 ms at the chosen candidates, whatever the others took."""
    table = registry.TuningTable(key={}, path=None)
    for shape, chosen_ms in (("8x4", 1.0), ("4x8", 2.0)):
        table.entries[f"linear|{shape}:bfloat16|64"] = {
            "chosen": "amx_c", "ms": {"amx_c": chosen_ms, "torch": 0.1 * chosen_ms, "slow": None},
            "dropped": {}, "work": 2.0 * 64 * 32, "unit": "flop",
        }  # fmt: skip
    rate = kernel_choice.table_linear_rate(["8x4", "8x4", "4x8"], table, torch.bfloat16, max_rows=50)
    assert rate == pytest.approx(3 * 4096 / 4e-3)
    # a shape the table lacks, another dtype, or a chosen candidate without a time: no figure
    assert kernel_choice.table_linear_rate(["8x4", "16x4"], table, torch.bfloat16, 50) is None
    assert kernel_choice.table_linear_rate(["8x4"], table, torch.float32, 50) is None
    table.entries["linear|8x4:bfloat16|64"]["chosen"] = "slow"
    assert kernel_choice.table_linear_rate(["8x4"], table, torch.bfloat16, 50) is None


def test_the_table_key_covers_the_modules_that_measure_the_choices(tmp_path, monkeypatch):
    """A change to how a choice is measured (a chooser module) makes a cached table stale."""
    key = kernel_choice.tuning_key(torch.bfloat16, num_threads=2)
    assert {k: v for k, v in key.items() if k != "choosers"} == registry.machine_key(torch.bfloat16, 2)
    copy = tmp_path / "model"
    copy.mkdir()
    for name in kernel_choice._CHOOSER_SOURCES:
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        (copy / name).write_bytes((ROOT / "batchgen" / "model" / name).read_bytes())
    paths = [copy / name for name in kernel_choice._CHOOSER_SOURCES]
    assert registry.files_hash(copy, paths) == key["choosers"]
    stack_choice = copy / "kernel_choice" / "stack.py"
    stack_choice.write_text(stack_choice.read_text() + "\n# changed\n")
    assert registry.files_hash(copy, paths) != key["choosers"]


def test_a_gpu_table_is_keyed_by_the_gpu_cuda_and_triton(monkeypatch) -> None:
    """A table measured on one GPU, CUDA or Triton build is not another's."""
    triton = pytest.importorskip("triton", reason="the CUDA path's key names Triton's version")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    cpu_key = kernel_choice.tuning_key(torch.bfloat16, num_threads=2)
    gpu_key = kernel_choice.tuning_key(torch.bfloat16, num_threads=2, device=torch.device("cuda"))
    assert gpu_key == {
        **cpu_key,
        "gpu": "NVIDIA H200",
        "gpu_capability": "9.0",
        "cuda": "13.0",
        "triton": triton.__version__,
    }
    assert kernel_choice.tuning_key(torch.bfloat16, 2, torch.device("cpu")) == cpu_key


def _model_on_backend(name: str) -> SimpleNamespace:
    """What `apply_kernels` reads of a model off the CPU: its first layer's attention heads and backend."""
    attention = SimpleNamespace(num_heads=4, num_kv_heads=2, head_dim=64, backend=SimpleNamespace(name=name))
    layer = SimpleNamespace(self_attn=attention)
    return SimpleNamespace(model=SimpleNamespace(layers=[layer]), parameters=lambda: iter([torch.zeros(1)]))


def test_off_the_cpu_the_linears_are_not_measured_and_the_summary_says_so() -> None:
    """On CUDA the linears stay torch's and attention is the backend's: the start line must not call
    that "reference: plain torch" (seen on an H200 bench, which ran the Triton kernels)."""
    model = _model_on_backend("torch")
    choice = kernel_choice.apply_kernels(model, "auto", torch.device("cuda"), max_rows=8, max_logit_rows=8)
    assert choice.table is None and not choice.linears and not choice.prefill_attention
    assert choice.summary() == "cuda: torch linears; attention from the attention backend (not measured)"


def test_on_cuda_the_triton_backend_gets_its_measured_prefill_attention(tmp_path, monkeypatch) -> None:
    """The chooser is handed the model's heads, the step's rows and the cache's block size, and its
    answer goes to the backend and the start line. (The measurement itself: tests/kernels/triton.)"""
    calls = []

    def tune(table, num_heads, num_kv_heads, head_dim, dtype, max_rows, device, block_size):
        calls.append((num_heads, num_kv_heads, head_dim, dtype, max_rows, device.type, block_size))
        return ["triton", "triton", "sdpa", "sdpa"]

    monkeypatch.setattr(kernel_choice, "tune_triton_prefill_attention", tune)
    monkeypatch.setattr(kernel_choice, "tuning_key", lambda dtype, device=None: {"gpu": "test"})
    monkeypatch.setattr(registry, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    model = _model_on_backend("triton")
    choice = kernel_choice.apply_kernels(
        model, "auto", torch.device("cuda"), max_rows=8, max_logit_rows=8, block_size=32
    )
    assert calls == [(4, 2, 64, torch.float32, 8, "cuda", 32)]
    assert model.model.layers[0].self_attn.backend.prefill_by_bucket == ["triton", "triton", "sdpa", "sdpa"]
    assert choice.summary() == (
        "cuda: torch linears; first prefill chunks triton 1-2, sdpa 4-8 rows (after a cached prefix: triton)"
    )


def test_a_table_timed_beside_a_busy_process_is_timed_again_on_a_quiet_start(tiny_model_dir, monkeypatch):
    """The engine records the other processes' load over its measurement; a later start on a quiet
    machine measures again instead of trusting timings that were not the kernels' own."""
    path = str(tiny_model_dir("llama"))
    threads = torch.get_num_threads()

    class BusyWhileMeasuring(kernel_choice.LoadSample):
        def other_cores_since(self, earlier) -> float:
            return 1.0

    monkeypatch.setattr(kernel_choice, "LoadSample", BusyWhileMeasuring)
    first = LLM(path, dtype="float32", max_num_seqs=4, device="cpu", kernels="auto", num_threads=threads)
    saved = json.loads(first.llm_engine.runner.kernel_choice.table.path.read_text())
    assert saved["others_load"] == 1.0 and saved["entries"]
    del first

    class QuietWhileMeasuring(kernel_choice.LoadSample):
        def other_cores_since(self, earlier) -> float:
            return 0.0

    monkeypatch.setattr(kernel_choice, "LoadSample", QuietWhileMeasuring)
    monkeypatch.setattr(registry, "other_load", lambda seconds: 0.0)  # the machine is quiet now
    timed = []
    real_timing = registry.fastest_seconds
    monkeypatch.setattr(registry, "fastest_seconds", lambda *a, **k: timed.append(1) or real_timing(*a, **k))
    second = LLM(path, dtype="float32", max_num_seqs=4, device="cpu", kernels="auto", num_threads=threads)
    assert timed, "a table measured on a busy machine must be measured again once the machine is quiet"
    assert second.llm_engine.runner.kernel_choice.table.others_load == 0.0


def test_a_quantized_linear_times_its_float_candidates_at_every_bucket(monkeypatch) -> None:
    """An int8 weight's float copy loses the few-row buckets (more bytes) and may win the many-row
    ones (a real matmul): no candidate may stop being timed as rows grow, or a prefill would run
    whatever won at 2 rows (it ran the int8 kernel at half oneDNN's rate on an AVX2 machine).
    Pruning made certain here: any candidate behind the fastest would be dropped after 2 buckets."""
    from batchgen.kernels.cpu.int8_weight import Int8Weight

    monkeypatch.setattr(registry, "PRUNE_RATIO", 0.0)

    torch.manual_seed(0)
    linear = nn.Linear(256, 128, bias=False)
    table = registry.TuningTable(key={}, path=None)
    quantized = Int8Weight.quantize(linear.weight.detach())
    with torch.no_grad():  # as quantize_model leaves it: the float copy is the dequantized weight
        linear.weight.copy_(quantized.dequantize())
    times = linear_choice.tune_linear(table, linear, 64, quantized)
    float_names = set(cpu_linear.linear_candidates(linear.weight.detach(), None))
    for bucket in times:
        timed_float = {name for name, ms in bucket.items() if name in float_names and ms is not None}
        assert timed_float, f"no float candidate timed at a bucket: {bucket}"
    names_at = [{n for n, ms in bucket.items() if ms is not None} for bucket in times]
    assert all(names == names_at[0] for names in names_at)  # the same candidates at every bucket


def _int8_stack_entries(tiny_model_dir, dtype: str):
    """The tiny Llama's `--quantization int8 --kernels auto` runner in `dtype` (8 sequences at a
    time), and its tuning table's decoder stack entries under the "/int8" shape by row bucket (each
    of 1, 2, 4 and 8 present)."""
    llm = LLM(
        str(tiny_model_dir("llama")),
        dtype=dtype,
        max_num_seqs=8,
        device="cpu",
        kernels="auto",
        quantization="int8",
    )
    runner = llm.llm_engine.runner
    entries = {k: e for k, e in runner.kernel_choice.table.entries.items() if k.startswith("decoder_stack|")}
    int8 = {int(k.rsplit("|", 1)[1]): e for k, e in entries.items() if k.split("|")[1].endswith("/int8")}
    assert sorted(int8) == [1, 2, 4, 8]
    return runner, int8


@NEEDS_BF16_KERNEL
def test_an_int8_models_stack_times_its_int8_linears_beside_the_bf16_ones(tiny_model_dir):
    """`--quantization int8` in bf16: the stack is measured under its own table shape ("/int8") with
    a third candidate, its linears on the int8 weights ("stack_int8"); where that wins, the stack
    runs "int8_c_dpbf16" at that bucket and holds every layer's int8 weight."""
    from batchgen.kernels.cpu.quantized_linear import bf16_dot_available

    if not bf16_dot_available():
        pytest.skip("the int8 kernel's VDPBF16PS tiles are not built here")
    runner, int8 = _int8_stack_entries(tiny_model_dir, "bfloat16")
    choice, stack = runner.kernel_choice, runner.model.decoder_stack
    assert int8[1]["ms"].get("stack_int8"), int8[1]  # timed (pruning may skip it at later buckets)
    linears = {"stack": "bf16_c", "stack_amx": "amx_c", "stack_int8": "int8_c_dpbf16"}
    stack_rows = choice.stack_max_rows or 0
    assert choice.stack_linears == [
        linears[int8[rows]["chosen"]] for rows in (1, 2, 4, 8) if rows <= stack_rows
    ]
    if stack is not None:
        assert stack.int8_applies() and all(layer.int8 is not None for layer in stack.layers)


@pytest.mark.skipif(cpu_kernels.load_library() is None, reason="no C compiler to build the CPU kernels")
def test_a_float32_int8_models_stack_times_its_int8_linears_against_the_layers(tiny_model_dir):
    """`--quantization int8` in float32 (any CPU, AVX2 among them): the float32 stack's one
    candidate, its linears on the int8 weights ("stack_int8", run as "int8_c"), is timed against
    the per-layer path under the "/int8" shape; where it wins the stack runs float32, reading the
    very int8 weights its layers hold, and no layout is held for it beyond theirs."""
    runner, int8 = _int8_stack_entries(tiny_model_dir, "float32")
    choice, stack = runner.kernel_choice, runner.model.decoder_stack
    assert set(int8[1]["ms"]) == {"layers", "stack_int8"} and int8[1]["ms"]["stack_int8"], int8[1]
    stack_rows = choice.stack_max_rows or 0
    expected = 0
    for rows in (1, 2, 4, 8):
        if int8[rows]["chosen"] != "stack_int8":
            break
        expected = rows
    assert stack_rows == expected and choice.stack_linears == ["int8_c"] * len(
        [r for r in (1, 2, 4, 8) if r <= expected]
    )
    assert (stack is not None) == bool(expected)
    if stack is not None:
        assert stack.dtype == torch.float32 and stack.int8_applies()
    for name, module in runner.model.named_modules():
        if isinstance(module, TunedLinear) and name.startswith("model.layers."):
            runs = set(module.by_bucket)
            if stack is not None and not any(kind.startswith("int8_c") for kind in runs):
                runs.add("int8_c")  # the stack's int8 weight
            assert set(module.impls) == runs, name


def test_a_quantized_layer_holds_one_float_copy_at_most() -> None:
    """The int8 kernel runs the few-row buckets; torch's plain copy and oneDNN's prepacked one each
    win some many-row buckets by more than the second-layout margin: one of them (the one that
    loses least over those buckets, oneDNN here) takes every bucket the int8 layout leaves, so the
    layer holds two layouts, not three."""
    times = [
        {"int8_c": 1.0, "torch": 3.0, "onednn": 3.0},
        {"int8_c": 2.0, "torch": 2.5, "onednn": 2.5},
        {"int8_c": 10.0, "torch": 5.0, "onednn": 5.2},  # torch a little ahead
        {"int8_c": 20.0, "torch": 12.0, "onednn": 8.0},  # oneDNN far ahead
        {"int8_c": 40.0, "torch": 30.0, "onednn": 16.0},
    ]
    plan = linear_choice.plan_layouts(times, primary="int8")
    assert plan == ["int8_c", "int8_c", "onednn", "onednn", "onednn"]
    # Where the second layout loses to the primary at a bucket, the primary runs there.
    times[2] = {"int8_c": 5.0, "torch": 4.0, "onednn": 6.0}
    assert linear_choice.plan_layouts(times, primary="int8")[2] == "int8_c"
    # An unquantized layer alike: bf16_c's packed layout primary, one float copy beside it.
    float_times = [{"bf16_c": t["int8_c"], "torch": t["torch"], "onednn": t["onednn"]} for t in times]
    assert (
        len({WEIGHT_LAYOUTS[n] for n in linear_choice.plan_layouts(float_times, primary="packed_bf16")}) == 2
    )
