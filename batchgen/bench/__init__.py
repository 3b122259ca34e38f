"""`batchgen bench`: workloads, configurations (continuous, static, Hugging Face and vLLM baselines), metrics, report.

cli, settings, spec  the Typer command; `BenchSettings` and the configurations they name; `WorkloadSpec`
runner, model_facts  every configuration of one bench on one workload; what it needs of the model
workload/     distributions (longtail, uniform, fixed, arrivals), traces (Azure), job (`file:PATH`)
baselines/    continuous and static (batchgen's engine), hf (transformers), vllm (+ vllm_child, run
              in vLLM's own interpreter)
report/       metrics (records, summaries, resources), ceiling, roofline, rates (measured between
              runs), json_report, table (Rich), plot (PNG), profile (`--profile`: cProfile of the steps)
"""

from __future__ import annotations
