"""Torch implementations of the math (the CPU path) and float64 references for tests."""
