"""GPU kernels terra runs inside vLLM (Triton; each checked against a float64 reference)."""
