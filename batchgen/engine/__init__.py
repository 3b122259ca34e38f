"""Engine core: requests, KV-block management, scheduling policies, the step loop."""
