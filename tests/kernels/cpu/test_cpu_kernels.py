"""The C kernel library: its build, cache and fallback, and the bf16 element-wise ops against torch."""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import tempfile
import time

import pytest
import torch
import torch.nn.functional as F

from batchgen import LLM, cache
from batchgen.kernels.cpu import attention as cpu_attention
from batchgen.kernels.cpu import library as cpu_kernels
from batchgen.kernels.cpu import linear as cpu_linear
from batchgen.kernels.cpu import ops as cpu_ops
from batchgen.kernels.cpu.linear import AmxLinear
from batchgen.model.attention import TorchAttentionBackend, select_backend, store_kv_cache_torch
from batchgen.model.layers import apply_rotary
from batchgen.model.runner import StepInput

pytestmark = pytest.mark.skipif(
    cpu_kernels._compiler() is None, reason="no C compiler ($CC, cc, gcc, clang) to build the CPU kernels"
)

BF16_ULP = 2**-7  # relative spacing of bf16 values (8 significant bits)


def within_one_ulp(got: torch.Tensor, expected: torch.Tensor) -> None:
    """All values within one bf16 rounding of each other, and nearly all identical."""
    assert got.dtype == expected.dtype == torch.bfloat16 and got.shape == expected.shape
    g, e = got.float(), expected.float()
    assert ((g - e).abs() <= BF16_ULP * e.abs() + 1e-30).all()
    assert (g == e).float().mean() > 0.99


@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 576 runs on all threads
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_matches_hf_formula(rows, with_delta):
    torch.manual_seed(0)
    hidden = (torch.randn(rows, 576) * 3).to(torch.bfloat16)
    delta = torch.randn(rows, 576).to(torch.bfloat16)
    weight = (torch.randn(576) * 0.3 + 1).to(torch.bfloat16)
    expected_hidden = hidden + delta if with_delta else hidden.clone()
    h = expected_hidden.float()
    normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    expected = weight * normed  # LlamaRMSNorm: a bf16 product of the rounded normed value
    got = cpu_ops.add_rms_norm_bf16(hidden, delta if with_delta else None, weight, 1e-5)
    assert torch.equal(hidden, expected_hidden)  # the residual add is in place, rounded like torch's
    within_one_ulp(got, expected)


@pytest.mark.parametrize("rows", [1, 5, 64])  # 64 x 1536 runs on all threads
def test_silu_mul_matches_torch(rows):
    torch.manual_seed(0)
    gate_up = (torch.randn(rows, 2 * 1536) * 4).to(torch.bfloat16)
    gate, up = gate_up.split(1536, dim=-1)
    within_one_ulp(cpu_ops.silu_mul_bf16(gate_up), F.silu(gate) * up)


def test_silu_mul_vector_loop_and_scalar_tail_agree_on_every_bf16_value():
    """The compiler vectorizes the loop over a row and finishes its last `cols % 16` values in a
    scalar epilogue: both give the same bits for every bf16 gate value (NaN aside), so a value's
    result does not depend on where it sits in the row."""
    gate = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gate = gate[~gate.isnan()]
    up = torch.randn(gate.numel()).mul(3).to(torch.bfloat16)
    vector = cpu_ops.silu_mul_bf16(torch.cat([gate, up])[None])[0]  # all but a few values in vectors
    width = 15  # narrower than a vector: rows of the scalar loop alone
    pad = -gate.numel() % width
    gate_rows = torch.cat([gate, gate[:pad]]).view(-1, width)
    up_rows = torch.cat([up, up[:pad]]).view(-1, width)
    scalar = cpu_ops.silu_mul_bf16(torch.cat([gate_rows, up_rows], dim=1)).flatten()[: gate.numel()]
    assert torch.equal(vector.view(torch.int16), scalar.view(torch.int16))
    big = torch.full((1, 32), -3e38).to(torch.bfloat16)
    assert (
        cpu_ops.silu_mul_bf16(torch.cat([big, torch.ones_like(big)], dim=1)).eq(0).all()
    )  # vector underflow


@pytest.mark.parametrize("rows", [1, 3, 600])  # 600 rows run on all threads
def test_rotary_is_bitwise_the_torch_formula(rows):
    """Same operations, same roundings: q and k equal the torch path exactly, from a strided QKV slice."""
    torch.manual_seed(0)
    q_heads, kv_heads, head_dim = 9, 3, 64
    qkv = torch.randn(rows, (q_heads + 2 * kv_heads) * head_dim).to(torch.bfloat16)
    qk = qkv[:, : (q_heads + kv_heads) * head_dim].view(rows, q_heads + kv_heads, head_dim)
    angles = torch.rand(rows, head_dim // 2) * 6.3
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(torch.bfloat16)[:, None, :], emb.sin().to(torch.bfloat16)[:, None, :]
    q, k = cpu_ops.rotary_bf16(qk, cos, sin, q_heads)
    expected = apply_rotary(qk, (cos, sin))
    assert q.is_contiguous() and k.is_contiguous()
    assert torch.equal(q, expected[:, :q_heads]) and torch.equal(k, expected[:, q_heads:])


def test_bad_layouts_are_refused():
    x = torch.randn(4, 8).to(torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous columns"):
        cpu_ops.add_rms_norm_bf16(x.t(), None, torch.ones(4, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="weight"):
        cpu_ops.add_rms_norm_bf16(x, None, torch.ones(5, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="even width"):
        cpu_ops.silu_mul_bf16(torch.randn(2, 7).to(torch.bfloat16))


def make_caches(
    dtype: torch.dtype, num_blocks: int = 6, block_size: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    k_cache = torch.randn(num_blocks, block_size, 3, 64).to(dtype)
    return k_cache, torch.randn_like(k_cache)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 5, 800])  # 800 f32 rows (2.4 MB) run on all threads
def test_store_kv_writes_the_rows_torch_writes(dtype, rows):
    """Bitwise the torch path's cache after the write, from a strided value slice; -1 rows skipped."""
    torch.manual_seed(0)
    k_cache, v_cache = make_caches(dtype, num_blocks=256 if rows > 24 else 6)
    qkv = torch.randn(rows, (9 + 2 * 3) * 64).to(dtype)
    key = qkv[:, 9 * 64 : 12 * 64].view(rows, 3, 64)
    value = qkv[:, 12 * 64 :].view(rows, 3, 64)  # rows 15 * 64 elements apart
    slots = torch.randperm(k_cache.shape[0] * k_cache.shape[1])[:rows]
    if rows > 1:
        slots[1] = -1
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kv_cache_torch(key, value, expected_k, expected_v, slots)
    cpu_ops.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert torch.equal(k_cache.view(-1, 3, 64)[slots[0]], key[0])


def test_store_kv_refuses_bad_slots_and_layouts():
    k_cache, v_cache = make_caches(torch.bfloat16)
    before = k_cache.clone(), v_cache.clone()
    key = torch.randn(3, 3, 64).to(torch.bfloat16)
    for bad in (24, -2):  # 6 blocks x 4 slots
        with pytest.raises(ValueError, match=rf"slot_mapping\[2\] = {bad} is outside the cache's 24 slots"):
            cpu_ops.store_kv(key, key, k_cache, v_cache, torch.tensor([0, 1, bad]))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])  # nothing written
    with pytest.raises(ValueError, match="contiguous rows"):
        cpu_ops.store_kv(
            key.transpose(1, 2).contiguous().transpose(1, 2), key, k_cache, v_cache, torch.arange(3)
        )
    with pytest.raises(ValueError, match="must be a CPU torch.bfloat16"):
        cpu_ops.store_kv(key.float(), key, k_cache, v_cache, torch.arange(3))
    with pytest.raises(ValueError, match="int64"):
        cpu_ops.store_kv(key, key, k_cache, v_cache, torch.arange(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="same number of rows"):
        cpu_ops.store_kv(key, key[:2], k_cache, v_cache, torch.arange(3))


def test_silu_and_attention_weights_underflow_to_zero():
    """exp of a very negative input is 0, not float32's smallest normal (which large values amplify)."""
    gate_up = torch.tensor([[-1e30, -1e37, -3e38, 1.0, 1.0, 1.0]]).to(torch.bfloat16)
    assert cpu_ops.silu_mul_bf16(gate_up).tolist() == [[0.0, 0.0, 0.0]]
    # One KV head, two rows: the second scores 200 below the first and carries a huge value.
    k_cache = torch.zeros(1, 16, 1, 16)
    v_cache = torch.zeros(1, 16, 1, 16)
    k_cache[0, 0, 0, 0], k_cache[0, 1, 0, 0] = 1.0, -1.0
    v_cache[0, 1, 0, :] = 1e30
    query = torch.zeros(1, 1, 16)
    query[0, 0, 0] = 100.0
    tables = torch.zeros(1, 1, dtype=torch.int32)
    lens = torch.tensor([2], dtype=torch.int32)
    out = cpu_attention.paged_decode_attention_cpu(query, k_cache, v_cache, tables, lens, 1.0)
    assert torch.equal(out, torch.zeros_like(out))


def test_rotary_refuses_mismatched_tables():
    qk = torch.randn(3, 4, 8).to(torch.bfloat16)
    cos = torch.randn(3, 1, 8).to(torch.bfloat16)
    with pytest.raises(ValueError, match="bf16"):
        cpu_ops.rotary_bf16(qk, cos, cos.float(), 2)
    with pytest.raises(ValueError, match="must hold"):
        cpu_ops.rotary_bf16(qk, cos, cos[:2], 2)


def _prefill_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """float32 logits `[len(prompts), vocab]` of one prefill step of `prompts` through `llm`'s model."""
    runner = llm.llm_engine.runner
    seqs, block = [], 0
    for tokens in prompts:
        blocks = list(range(block, block + -(-len(tokens) // runner.block_size)))
        block += len(blocks)
        seqs.append(StepInput(token_ids=tokens, start=0, block_table=blocks, sample=True))
    input_ids, positions, meta, logits_indices = runner.prepare(seqs)
    with torch.inference_mode():
        return runner.model(input_ids, positions, runner.kv_caches, meta, logits_indices).float()


def test_cpu_backend_runs_the_c_ops_and_torch_backend_does_not(tiny_model_dir, monkeypatch):
    """bf16 logits of the "cpu" backend (C ops) agree with the plain "torch" backend's within bf16
    rounding, and the "torch" backend calls no C kernel."""
    path = str(tiny_model_dir("llama"))
    prompts = [[1 + i, 20 + 3 * i, 7, 300 + i] * (1 + i) for i in range(6)]
    calls: list[str] = []
    for name in ("add_rms_norm_bf16", "silu_mul_bf16", "rotary_bf16", "store_kv"):
        original = getattr(cpu_ops, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(cpu_ops, name, counted)
    swiglu = AmxLinear.swiglu  # SiLU-and-multiply inside the AMX kernel, where that runs the gate/up
    monkeypatch.setattr(AmxLinear, "swiglu", lambda self, x: calls.append("amx_swiglu") or swiglu(self, x))
    fused_llm = LLM(path, dtype="bfloat16", attention_backend="cpu", device="cpu")
    # The layer-by-layer path (the C decoder stack calls the same kernels from C, where they cannot
    # be counted; tests/kernels/cpu/test_cpu_stack.py shows it gives the same bits).
    fused_llm.llm_engine.runner.model.decoder_stack = None
    fused = _prefill_logits(fused_llm, prompts)
    assert {"add_rms_norm_bf16", "rotary_bf16", "store_kv"} <= set(calls)
    assert {"silu_mul_bf16", "amx_swiglu"} & set(calls)
    calls.clear()
    plain_llm = LLM(path, dtype="bfloat16", attention_backend="torch", device="cpu")
    plain = _prefill_logits(plain_llm, prompts)
    assert calls == []
    # The C ops round where Hugging Face's bf16 modules round, but sum in another order: logits
    # differ by a few bf16 ulps of the activations (greedy tokens of a random-weight model can then
    # flip at near-ties, so logits are compared rather than tokens).
    assert fused.shape == plain.shape == (6, fused_llm.llm_engine.runner.config.vocab_size)
    assert (fused - plain).abs().max().item() <= 0.05 * plain.abs().max().item()


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    """load_library() rebuilt from scratch into a temporary cache, and restored afterwards."""
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "batchgen"))
    cpu_kernels.load_library.cache_clear()
    cpu_attention.supports.cache_clear()
    yield tmp_path
    cpu_kernels.load_library.cache_clear()
    cpu_attention.supports.cache_clear()


def test_builds_into_the_cache_once(fresh_library):
    lib = cpu_kernels.load_library()
    assert lib is not None
    built = list((fresh_library / "batchgen" / "cpu_kernels").glob("batchgen_cpu-*.so"))
    assert len(built) == 1
    assert cpu_kernels.load_library() is lib


def test_the_kernels_compile_with_the_first_flag_set_where_the_compiler_takes_it(fresh_library, tmp_path):
    """A compile error in one kernel source must not pass unseen: the build would fall back to a
    flag set without -march=native, and every kernel would run (correctly but) several times slower."""
    compiler = cpu_kernels._compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    probe = tmp_path / "probe.c"
    probe.write_text("int probe(void) { return 1; }\n")
    first = cpu_kernels.flag_sets()[0]
    flags = [*cpu_kernels.BASE_FLAGS, *first]
    if subprocess.run([*compiler, *flags, str(probe), "-o", str(tmp_path / "probe.so")]).returncode != 0:
        pytest.skip(f"{compiler[0]} does not take {' '.join(first)}")
    assert cpu_kernels.load_library() is not None
    (record,) = (fresh_library / "batchgen" / "cpu_kernels").glob("batchgen_cpu-*.json")
    assert json.loads(record.read_text())["flags"] == first


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the ISA cap names x86 levels")
def test_the_avx2_cap_builds_for_avx2_and_offers_no_avx512_kernel(fresh_library, monkeypatch):
    """`BATCHGEN_MAX_CPU_ISA=AVX2` emulates an AVX2-only CPU (a Zen 3) for batchgen's own kernels:
    they are compiled for x86-64-v3 instead of the machine, into a build of their own, and no
    AVX512-BF16 or AMX kernel is offered, whatever this machine has."""
    for variable in cpu_kernels.ISA_CAP_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    native_flags = cpu_kernels.flag_sets()[0]
    monkeypatch.setenv("BATCHGEN_MAX_CPU_ISA", "avx2")
    capped = cpu_kernels.flag_sets()[0]
    assert "-march=x86-64-v3" in capped and "-march=native" not in capped
    assert "-mprefer-vector-width=512" not in capped and capped != native_flags
    assert cpu_kernels.load_library() is not None
    (record,) = (fresh_library / "batchgen" / "cpu_kernels").glob("batchgen_cpu-*.json")
    assert json.loads(record.read_text())["flags"] == capped
    assert not cpu_kernels.isa_cap_allows("avx512_bf16") and not cpu_kernels.isa_cap_allows("amx")
    assert not cpu_linear.bf16_kernel_available() and not cpu_linear.amx_kernel_available()


def test_an_unknown_isa_cap_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("BATCHGEN_MAX_CPU_ISA", "avx9000")
    with pytest.raises(ValueError, match=r"BATCHGEN_MAX_CPU_ISA='avx9000' is not one of SSE41, .*AVX2"):
        cpu_kernels.flag_sets()


def test_a_new_build_prunes_builds_unused_for_a_month(fresh_library):
    """Old builds (other sources or compilers) are deleted when a new one is made; recent ones stay."""
    directory = fresh_library / "batchgen" / "cpu_kernels"
    directory.mkdir(parents=True)
    month = cpu_kernels.UNUSED_BUILD_SECONDS
    for name, age in (("old", month + 3600), ("recent", month - 3600)):
        for suffix in (".so", ".json"):
            path = directory / f"batchgen_cpu-{name}{suffix}"
            path.write_text("{}")
            os.utime(path, (time.time() - age, time.time() - age))
    assert cpu_kernels.load_library() is not None
    left = sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))
    assert "batchgen_cpu-old.so" not in left and "batchgen_cpu-old.json" not in left
    assert {"batchgen_cpu-recent.so", "batchgen_cpu-recent.json"} <= set(left)
    assert len(left) == 4  # the recent pair and the new build with its record
    new_record = next(directory.glob("batchgen_cpu-[0-9a-f]*.json"))
    assert time.time() - new_record.stat().st_mtime < 60  # touched by the load


def test_no_compiler_falls_back_to_torch(fresh_library, monkeypatch, caplog):
    monkeypatch.setenv("CC", "/bin/false")
    with caplog.at_level(logging.WARNING, logger="batchgen.kernels.cpu.library"):
        assert cpu_kernels.load_library() is None
    assert "could not build" in caplog.text
    assert not cpu_ops.bf16_ops_apply(torch.ones(2, dtype=torch.bfloat16))
    assert isinstance(select_backend("auto", torch.device("cpu")), TorchAttentionBackend)
    assert select_backend("auto", torch.device("cpu")).name == "torch"
    with pytest.raises(ValueError, match="attention_backend='torch'"):
        select_backend("cpu", torch.device("cpu"))


def test_disabled_by_environment(fresh_library, monkeypatch, caplog):
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", "0")
    with caplog.at_level("WARNING", logger="batchgen.kernels.cpu.library"):
        assert cpu_kernels.load_library() is None
    assert ["BATCHGEN_CPU_KERNELS=0: the C kernels are off" in r.getMessage() for r in caplog.records] == [
        True
    ]
    assert select_backend("auto", torch.device("cpu")).name == "torch"
    # Forcing the kernels names the variable that turned them off.
    with pytest.raises(ValueError, match="BATCHGEN_CPU_KERNELS=0 turns off; unset BATCHGEN_CPU_KERNELS"):
        select_backend("cpu", torch.device("cpu"))


def test_a_corrupt_cached_library_is_rebuilt(fresh_library):
    """A truncated library would crash dlopen (SIGBUS): it fails its checksum and is rebuilt."""
    assert cpu_kernels.load_library() is not None
    (built,) = (fresh_library / "batchgen" / "cpu_kernels").glob("batchgen_cpu-*.so")
    good = built.read_bytes()
    # A new file in its place (this process has the old one mapped: truncating that would crash it).
    half = built.with_name("half.so")
    half.write_bytes(good[: len(good) // 2])
    half.replace(built)
    cpu_kernels.load_library.cache_clear()
    assert cpu_kernels.load_library() is not None
    assert built.read_bytes() == good


def test_cc_with_arguments(fresh_library, monkeypatch):
    monkeypatch.setenv("CC", "env gcc")  # a wrapper command, as "ccache gcc"
    if cpu_kernels.shutil.which("gcc") is None:
        pytest.skip("no gcc here")
    assert cpu_kernels._compiler() == ["env", "gcc"]
    assert cpu_kernels.load_library() is not None


def test_cache_dir_without_a_home(monkeypatch):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("BATCHGEN_CACHE", raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(cache.Path, "home", staticmethod(no_home))
    assert str(cpu_kernels._cache_dir()).startswith(tempfile.gettempdir())


def test_the_triton_backend_without_triton_names_the_extra(monkeypatch):
    """A CPU install has no Triton (the gpu and dev extras bring it): choosing it says how to get it."""
    import sys

    for name in list(sys.modules):
        if (
            name == "triton"
            or name.startswith(("triton.", "batchgen.kernels.triton"))
            or name.endswith("attention.triton_backend")
        ):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` fails as if not installed
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match=r"batchgen\[gpu\]"):
        select_backend("triton", torch.device("cpu"))
