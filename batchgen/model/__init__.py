"""The model side: flat batches in, logits out. Knows nothing about requests or files."""
