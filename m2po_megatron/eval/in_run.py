"""Evaluation during a run: avg@k pass@1 per benchmark through the rollout servers, printed and logged."""
from __future__ import annotations

import hashlib
import time
from pathlib import Path

from omegaconf import DictConfig


def eval_seed(run_seed: int, step: int) -> int:
    """The base sampling seed of the evaluation at ``step`` of a run seeded ``run_seed``: 62 bits of a hash,
    so that runs and steps draw unrelated samples (a sum such as run_seed + 7919 * step let runs with
    neighbouring seeds share most per-sample seeds), and a resumed run evaluates with the same seeds."""
    digest = hashlib.blake2b(f"m2po-eval/{int(run_seed)}/{int(step)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2


class Evaluator:
    """The run's eval sets, evaluated at the weights the servers hold (the loop syncs them to the trainer's
    first), scored by the run's reward pool; tables in RUN_DIR/eval/."""

    def __init__(self, cfg: DictConfig, client, tokenizer, eval_sets: list, rdir: Path, rewards):
        self.cfg, self.client, self.tokenizer, self.eval_sets = cfg, client, tokenizer, eval_sets
        self.rdir, self.rewards = rdir, rewards
        self.enabled = bool(eval_sets)
        self.runner = self._function_runner() if self.enabled else None

    def _function_runner(self):
        """eval.function's runner, or rollout.function's when that is not the built-in; None: the built-in
        benchmarks' avg@k (what single_turn would compute, with its seeds and tables)."""
        from m2po_megatron.agents.loader import DEFAULT_ROLLOUT
        from m2po_megatron.agents.runner import runner_for

        cfg, e = self.cfg, self.cfg.eval
        if (e.get("function") or cfg.rollout.get("function") or DEFAULT_ROLLOUT) == DEFAULT_ROLLOUT:
            return None
        sampling = {"temperature": e.temperature, "top_p": e.top_p,
                    "max_new_tokens": e.max_new_tokens or cfg.rollout.max_new_tokens}
        if cfg.rollout.top_k != -1:
            sampling["top_k"] = cfg.rollout.top_k
        return runner_for(cfg, self.tokenizer, self._score, function_key="eval.function", sampling=sampling,
                           fail_limit=0)

    def _score(self, text: str, row: dict, token_ids=None) -> float:
        """The recipe's reward of one answer (a failed term: reward.error_score); eval counts apart from training."""
        from m2po_megatron.reward.types import RewardInput

        ids = list(token_ids) if token_ids is not None else self.tokenizer(text, add_special_tokens=False)["input_ids"]
        (r,) = self.rewards.score([RewardInput(text, ids, row)])
        return float(r.score) if r.score is not None else float(self.cfg.reward.error_score)

    def due(self, step: int) -> bool:
        """An evaluation at this step by eval.interval (0: only before and after training) or eval.steps."""
        interval = self.cfg.eval.interval
        listed = step in (self.cfg.eval.get("steps") or ())
        return self.enabled and (listed or (interval > 0 and step % interval == 0))

    def __call__(self, step: int, version: int | None = None) -> dict:
        """Evaluate, print the accuracy; returns the metrics to log. `version`: the weights the servers were
        synced to (answers from other weights are counted and reported)."""
        return report_eval(self.evaluate(step, version), step, version)

    def evaluate(self, step: int, version: int | None = None) -> dict:
        from collections import Counter

        from m2po_megatron.eval.benchmarks import evaluate as run_eval
        from m2po_megatron.eval.rollout_generate import rollout_generate_fn

        cfg, e = self.cfg, self.cfg.eval
        versions: Counter = Counter()
        if self.runner is not None:
            from m2po_megatron.eval.function_eval import evaluate_function

            t0 = time.monotonic()
            out = evaluate_function(self.runner, self.client, self.eval_sets, eval_seed(cfg.run.seed, step),
                                    self._score, out_dir=self.rdir, step=step, versions=versions)
            out["time/eval"] = time.monotonic() - t0
            if version is not None:
                out["eval/answers_at_other_weights"] = sum(n for v, n in versions.items() if v != version)
            return out
        res = run_eval(rollout_generate_fn(self.client, seed=eval_seed(cfg.run.seed, step), versions=versions),
                       self.tokenizer, self.eval_sets, temperature=e.temperature, top_p=e.top_p,
                       max_new_tokens=e.max_new_tokens or cfg.rollout.max_new_tokens,
                       rewards=self.rewards, out_dir=self.rdir, step=step)
        out = {**res.metrics(), "time/eval": res.seconds}
        if version is not None:  # a server restarted during the evaluation answers with its base weights
            out["eval/answers_at_other_weights"] = sum(n for v, n in versions.items() if v != version)
        return out


def report_eval(metrics: dict, step: int, version: int | None = None) -> dict:
    """Print an evaluation's accuracy (the loop logs the same numbers), and say so when some answers came
    from other weights than the ones synced; returns the metrics."""
    per = [f"{k.split('/')[1]} {v:.1f}%" for k, v in metrics.items()
           if k.endswith("/pass@1") and k != "eval/avg/pass@1"]
    print(f"[m2po] eval at step {step}: pass@1 {metrics.get('eval/avg/pass@1', float('nan')):.1f}% "
          f"({', '.join(per)})", flush=True)
    other = metrics.get("eval/answers_at_other_weights", 0)
    if other:
        print(f"[m2po] eval at step {step}: {other} answers came from other weights than version {version} (a "
              f"rollout server restarted during the evaluation); these numbers mix weights", flush=True)
    return metrics
