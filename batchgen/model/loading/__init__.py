"""Loading a model: a spec (None for the default model, a GGUF file, a Hugging Face directory or a
hub id) -> a Hugging Face-style directory (`loader`), GGUF files dequantized once and cached
(`gguf_cache`), the digest that identifies a model's files for resume (`fingerprint`), and the
table of supported architectures with the errors for the rest (`architectures`).
"""
