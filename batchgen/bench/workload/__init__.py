"""Bench workloads: request lengths and prompts from distributions, Azure traces or a job file."""
