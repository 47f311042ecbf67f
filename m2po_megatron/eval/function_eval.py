"""In-run evaluation through a rollout function (eval.function, or the run's rollout.function when it is not
the built-in): each eval row is one group of the set's n_samples episodes; pass@1 is the share of samples
whose reward is 1 (the function's reward, else the recipe's reward of the policy's text), in the metric
names of the built-in evaluation (eval/<set>/pass@1, eval/avg/pass@1), so reports and plots read both."""
from __future__ import annotations

import functools
import json
from collections import Counter
from pathlib import Path
from typing import Optional

from m2po_megatron.agents.runner import RolloutRunner


def evaluate_function(runner: RolloutRunner, client, eval_sets: list, seed: int, score,
                      out_dir: Optional[Path] = None, step: int = 0, versions: Optional[Counter] = None,
                      timeout_s: float = 3600.0) -> dict:
    """score(text, row, token_ids) -> the recipe's reward for results without one. versions counts the weight version of each
    policy token's sample (its oldest), as the built-in evaluation counts its answers'."""
    from .rollout_generate import request_seed

    out, table = {}, []
    for es in eval_sets:
        futs = [client.run(functools.partial(runner.run_group, row=task.row, prompt_ids=list(task.prompt_ids),
                                             seed=request_seed(seed, 0, i, es.n_samples),
                                             group_id=f"eval{step}/{es.name}/{i}", n=es.n_samples))
                for i, task in enumerate(es.rows)]
        rewards, dropped = [], 0
        for task, fut in zip(es.rows, futs):
            for ep in fut.result(timeout_s):
                r = ep.result
                if r is None or r.finish_reason == "abort":
                    dropped += 1  # counted as a failure: an evaluation never hides a broken episode
                    rewards.append(0.0)
                    continue
                if versions is not None:
                    versions[min(v for v, m in zip(r.versions, r.loss_mask) if m)] += 1
                policy = [t for t, m in zip(r.token_ids, r.loss_mask) if m]
                text = runner.tok.decode(policy, skip_special_tokens=True)
                rewards.append(r.reward if r.reward is not None else score(text, task.row, policy))
        acc = sum(x >= 1.0 for x in rewards) / max(len(rewards), 1)
        out[f"eval/{es.name}/pass@1"] = 100 * acc
        out[f"eval/{es.name}/mean_reward"] = sum(rewards) / max(len(rewards), 1)
        out[f"eval/{es.name}/dropped"] = dropped
        table.append({"benchmark": es.name, "problems": len(es.rows), "samples": es.n_samples,
                      "pass@1": round(100 * acc, 2), "dropped": dropped})
    out["eval/avg/pass@1"] = sum(out[f"eval/{es.name}/pass@1"] for es in eval_sets) / len(eval_sets)
    # the function's own numbers and drops: eval_fn/custom/<name>, eval_fn/dropped/<problem>, ...
    out.update({f"eval_fn/{k.split('/', 1)[1]}": v for k, v in runner.stats().items()})
    if out_dir is not None:
        d = Path(out_dir) / "eval"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"step_{step}.json").write_text(json.dumps({"step": step, "function": runner.name, "table": table},
                                                         indent=1))
    return out
