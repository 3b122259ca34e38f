"""Writing a job's output: committed parts, the manifest, resume, run headers, the final file and its schema."""
