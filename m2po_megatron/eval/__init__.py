"""pass@1 (avg@k) evaluation on the math benchmarks, written against a generation callable."""

from .benchmarks import BenchmarkScore, EvalResult, EvalSet, evaluate, load_eval_sets, save_result
from .hf_generate import hf_generate_fn

__all__ = ["EvalSet", "EvalResult", "BenchmarkScore", "evaluate", "load_eval_sets", "save_result", "hf_generate_fn"]
