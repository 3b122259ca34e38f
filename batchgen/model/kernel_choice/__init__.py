"""The measured choice of kernels on the loaded model: linears, attention and the decoder stack, per shape bucket."""
