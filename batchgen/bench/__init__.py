"""`batchgen bench`: workloads, configurations (continuous, static, Hugging Face and vLLM baselines), metrics, report.

Modules:
    workloads     request lengths and prompts (longtail, uniform, fixed, Azure traces), arrivals
    traces        the Azure LLM inference traces and the log-normal fits of `longtail`
    job_workload  `file:PATH` workloads from a job file
    continuous    continuous batching through batchgen's engine
    static        padded static batching through batchgen's own engine (and helpers both share)
    hf_baselines  transformers `generate` in static batches and transformers' continuous batching
    vllm_baseline vLLM's `LLM.generate` in vLLM's own interpreter; vllm_child is what runs there
    metrics       per-request / per-step records, latency and throughput summaries, resource use
    ceiling       the workload's FLOPs and the measured matmul rate: the compute ceiling
    roofline      each run's least possible time from its own steps (FLOPs or bytes, per step)
    rates         the matmul rate and memory bandwidth measured between runs
    model_facts   what the bench needs of the model (tokenizer, config, dtype, KV-cache size)
    settings      `BenchSettings` and the configurations they name
    runner        runs every configuration of one bench on one workload
    report        the JSON report; table prints it (Rich), plot draws its timeline (PNG)
    cli           `bench_command`, the Typer command registered as `batchgen bench`
"""

from __future__ import annotations
