"""Benchmark helpers: reference engines run on the same weights and the same request trace as kvcli."""
