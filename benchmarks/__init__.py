"""The benchmark harness (``python -m benchmarks``): DESIGN.md section 5."""
