"""The configurations a bench compares: continuous and static batching, transformers, vLLM."""
