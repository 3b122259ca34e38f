"""The vLLM side of `batchgen bench --baselines vllm`: run in vLLM's own interpreter, never in batchgen's.

    VLLM_PYTHON batchgen/bench/baselines/vllm_child.py REQUEST.json RESULT.json

This file imports only the standard library and vLLM (the interpreter that runs it has no batchgen).
It reads one request (protocol 1, written by `batchgen.bench.baselines.vllm.child_request`)::

    {"protocol": 1, "model": DIR, "dtype": "bfloat16", "max_model_len": int,
     "max_num_seqs": int, "max_num_batched_tokens": int, "gpu_memory_utilization": float | null,
     "seed": int, "warmup": bool, "prompts": [[token id, ...], ...], "max_tokens": [int, ...]}

builds `vllm.LLM` on DIR with prefix caching off, runs an untimed warm-up (two 16-token prompts
that share nothing with the workload, 2 tokens each) when asked, then times one
`LLM.generate` over every prompt, given as token ids, each with its own `max_tokens`, greedy,
EOS ignored. It writes the result (protocol 1)::

    {"protocol": 1, "vllm_version": str, "elapsed_s": float, "output_tokens": int,
     "num_output_tokens": [int, ...] (in request order), "load_s": float, "warmup_s": float}

or, when anything fails, `{"protocol": 1, "error": "...", "stage": "import" | "request" | "load" |
"generate"}`. Exit status: 0 on success, 2 when vLLM cannot be imported, 3 for any other error.
"""

from __future__ import annotations

import json
import sys
import time
import traceback

PROTOCOL = 1
EXIT_NO_VLLM = 2
EXIT_ERROR = 3


def _write(path: str, payload: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f)


def _fail(path: str, stage: str, exc: BaseException, code: int) -> int:
    traceback.print_exc()  # the whole story goes to stderr, which the bench keeps the tail of
    first_line = (str(exc).strip().splitlines() or [""])[0]
    _write(path, {"protocol": PROTOCOL, "stage": stage, "error": f"{type(exc).__name__}: {first_line}"})
    return code


def _check_request(request: dict) -> None:
    """Raise ValueError when `request` is not a well-formed protocol-1 request."""
    if request.get("protocol") != PROTOCOL:
        raise ValueError(f"protocol {request.get('protocol')!r}, this script speaks {PROTOCOL}")
    prompts, max_tokens = request.get("prompts"), request.get("max_tokens")
    if not isinstance(prompts, list) or not isinstance(max_tokens, list) or len(prompts) != len(max_tokens):
        raise ValueError("prompts and max_tokens must be lists of the same length")
    if any(not p for p in prompts) or any(not isinstance(n, int) or n < 1 for n in max_tokens):
        raise ValueError("every prompt needs at least one token id and every max_tokens must be >= 1")


def main(argv: list[str]) -> int:
    """Run one request file into one result file (see the module docstring); returns the exit status."""
    if len(argv) != 2:
        print("usage: vllm_child.py REQUEST.json RESULT.json", file=sys.stderr)
        return 64
    request_path, result_path = argv
    try:
        with open(request_path, encoding="utf-8") as f:
            request = json.load(f)
        _check_request(request)
    except (OSError, ValueError) as exc:
        return _fail(result_path, "request", exc, EXIT_ERROR)
    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except Exception as exc:  # ImportError, or a broken install failing inside its own imports
        return _fail(result_path, "import", exc, EXIT_NO_VLLM)

    started = time.perf_counter()
    try:
        options = {
            "model": request["model"],
            "dtype": request["dtype"],
            "max_model_len": request["max_model_len"],
            "max_num_seqs": request["max_num_seqs"],
            "max_num_batched_tokens": request["max_num_batched_tokens"],
            "enable_prefix_caching": False,  # a fresh workload, and batchgen's bench runs it off too
            "seed": request.get("seed", 0),
        }
        if request.get("gpu_memory_utilization") is not None:
            options["gpu_memory_utilization"] = request["gpu_memory_utilization"]
        llm = LLM(**options)
    except Exception as exc:
        return _fail(result_path, "load", exc, EXIT_ERROR)
    load_s = time.perf_counter() - started

    def params(n: int) -> SamplingParams:
        # No min_tokens: with EOS ignored, max_tokens is exact, and min_tokens would add a logits
        # processor to every step that batchgen does not run.
        return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)

    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in request["prompts"]]
    warmup_s = 0.0
    try:
        if request.get("warmup", True):
            # The first prompt's head reversed (and repeated to 16 tokens): not a workload prompt.
            head = list(request["prompts"][0][:16])[::-1]
            warm = [TokensPrompt(prompt_token_ids=(head * 16)[:16]) for _ in range(2)]
            t = time.perf_counter()
            llm.generate(warm, params(2), use_tqdm=False)
            warmup_s = time.perf_counter() - t
        t = time.perf_counter()
        outputs = llm.generate(prompts, [params(n) for n in request["max_tokens"]], use_tqdm=False)
        elapsed = time.perf_counter() - t
    except Exception as exc:
        return _fail(result_path, "generate", exc, EXIT_ERROR)

    counts = [len(out.outputs[0].token_ids) if out.outputs else 0 for out in outputs]
    _write(
        result_path,
        {
            "protocol": PROTOCOL,
            "vllm_version": getattr(vllm, "__version__", "unknown"),
            "elapsed_s": elapsed,
            "output_tokens": sum(counts),
            "num_output_tokens": counts,
            "load_s": load_s,
            "warmup_s": warmup_s,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
