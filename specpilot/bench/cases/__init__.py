"""Benchmark case providers, one module per operator; each registers itself on import."""
