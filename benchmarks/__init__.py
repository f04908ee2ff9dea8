"""Benchmarks: peers measured in the same run, reported as ratios. Run: python -m benchmarks.run"""
