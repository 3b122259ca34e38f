"""`batchgen plan`: a job's rows, tokens, KV-cache fit and wall time, estimated without running it."""
