"""Reference generation (packed prefill, batched decode) and the `k3 generate` verb."""
