"""The machine's matmul rate and memory bandwidth, measured between a bench's runs.

On a shared machine the matmul rate moves within minutes (measured: docs/benchmarks.md), so the
rates are measured before the first run and again after every run: each run's share of the ceiling
is taken against the rates measured on either side of it, and the headline ceiling (and every run's
comparable roofline) against the median of all the measurements.
"""

from __future__ import annotations

from typing import Any

import torch

from batchgen.bench.report.ceiling import ModelShape, compute_ceiling, measure_matmul_rate
from batchgen.bench.report.metrics import RunResult
from batchgen.bench.report.roofline import (
    kv_bytes_per_token,
    measure_memory_bandwidth,
    roofline_seconds,
    weight_bytes,
)


class RateSamples:
    """The matmul rate (`ceiling.measure_matmul_rate`) and memory bandwidth
    (`roofline.measure_memory_bandwidth`) of one model's shapes, sampled between runs.

    Args:
        shape: the model's sizes (its linears are what is timed).
        dtype / device: the engine's.

    Attributes:
        first: the first matmul measurement, taken at construction (its `by_rows`, dtype and
            threads go in the report).
        samples: (matmul FLOP/s, memory bytes/s) of each `measure()`, in order.
    """

    def __init__(self, shape: ModelShape, dtype: torch.dtype, device: str) -> None:
        self.shape, self.dtype, self.device = shape, dtype, device
        self.first: dict[str, Any] = measure_matmul_rate(shape, dtype, device)
        self.samples: list[tuple[float, float]] = []

    def measure(self) -> tuple[float, float]:
        """One more sample (the first reuses the matmul rate measured at construction)."""
        flops_per_s = (
            measure_matmul_rate(self.shape, self.dtype, self.device)["flops_per_s"]
            if self.samples
            else self.first["flops_per_s"]
        )
        self.samples.append((flops_per_s, measure_memory_bandwidth(self.device)["bytes_per_s"]))
        return self.samples[-1]

    def ceiling(self, flops: dict[str, float], results: list[RunResult]) -> dict[str, Any]:
        """The workload's compute ceiling at the median matmul rate, with the memory figures; and in
        each batchgen run's `extra`, its roofline at the median rates (`roofline_s`, comparable
        between configurations) and at the matmul rate measured around it (`roofline_own_rate_s`).

        Args:
            flops: `ceiling.workload_flops` of the workload.
            results: the reported runs; those with `extra["matmul_flops_per_s"]` and steps get rooflines.
        """
        flops_samples = [r[0] for r in self.samples]
        bytes_samples = [r[1] for r in self.samples]
        median_rate = dict(self.first, flops_per_s=median(flops_samples), samples_flops_per_s=flops_samples)
        dtype_bytes = self.dtype.itemsize
        ceiling = compute_ceiling(flops, median_rate)
        ceiling["memory"] = {
            "bytes_per_s": median(bytes_samples),
            "samples_bytes_per_s": bytes_samples,
            "weight_bytes": weight_bytes(self.shape, dtype_bytes),
            "kv_bytes_per_token": kv_bytes_per_token(self.shape, dtype_bytes),
            # a mixture of experts: a step reads its routed experts' weights only (`step_bytes`)
            "routed_experts": self.shape.num_sparse_layers > 0,
        }
        bandwidth = ceiling["memory"]["bytes_per_s"]
        for result in results:
            own_rate = result.extra.get("matmul_flops_per_s")
            if result.skipped or own_rate is None or not result.steps:  # vllm: no steps to price
                continue
            # The bandwidth is the median for both: a single copy can read well above the median after
            # some runs, which would move a run's share by itself.
            # The weights' bytes as the run held them (quantized ones at their size), where it says.
            weights = result.extra.get("weight_bytes")
            result.extra["roofline_s"] = roofline_seconds(
                result.steps, self.shape, dtype_bytes, median_rate["flops_per_s"], bandwidth, weights
            )
            result.extra["roofline_own_rate_s"] = roofline_seconds(
                result.steps, self.shape, dtype_bytes, own_rate, bandwidth, weights
            )
        return ceiling


def median(values: list[float]) -> float:
    """The median (the lower middle value for an even count)."""
    return sorted(values)[(len(values) - 1) // 2]
