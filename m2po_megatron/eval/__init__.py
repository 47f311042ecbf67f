"""pass@1 (avg@k) evaluation on the math benchmarks, written against a generation callable."""
