"""Running a recipe's rollout function for one prompt group, and judging what it returns.

The function is awaited on the rollout client's event loop with a RolloutContext; past
rollout.function_timeout_s its task is cancelled. Each of the n results is checked (lengths, mask, log-probs
and versions on the policy's tokens, token ids, length limits, JSON-safe metadata); a bad one becomes an
`Episode` with a problem, which the generators drop with the ledger reason `bad_rollout` and count as
rollout_fn/dropped/<problem>. Nothing a plug-in returns or raises can stop the run, except that a run whose
first step's worth of episodes all failed stops with their reasons instead of spinning, and that the servers'
own failure (ServerUnavailable: no server within the client's retries) stops it as it would without plug-ins."""
from __future__ import annotations

import asyncio
import functools
import json
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional

from m2po_megatron.agents.types import RolloutContext, RolloutResult, ServerUnavailable, finite
from m2po_megatron.agents.client import GroupClient

# every reason a runner drops a sample for (rollout_fn/dropped/<problem>)
PROBLEMS = ("error", "timeout", "bad_result", "rejected", "bad_mask", "missing_logprobs", "missing_versions",
            "empty", "bad_tokens", "too_long")
WARN_PER_PROBLEM = 3  # printed in full; later ones of the same problem are only counted


class RolloutFunctionFailed(RuntimeError):
    """Every episode of the run's first step failed: the run stops with the reasons."""


@dataclass
class Episode:
    """One sample as the function returned it, normalised (env tokens: log-prob 0.0, version -1), or a problem."""
    result: Optional[RolloutResult]
    problem: Optional[str] = None
    detail: str = ""
    server: str = ""  # the server the group's calls went to (the run timeline's row)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_result(res, *, vocab_size: Optional[int], max_tokens: Optional[int], prompt_len: int
                 ) -> tuple[Optional[str], str]:
    """(problem, detail naming the field) of one result, or (None, "")."""
    if res is None:
        return "rejected", "the function returned None for it (its own rejection)"
    if not isinstance(res, RolloutResult):
        return "bad_result", f"got a {type(res).__name__}, expected a RolloutResult"
    if res.finish_reason not in ("stop", "length", "abort"):
        return "bad_result", f"finish_reason = {res.finish_reason!r} is not stop, length or abort"
    if res.finish_reason == "abort":
        return None, ""  # dropped as `aborted` whatever else it holds
    ids, mask = res.token_ids, res.loss_mask
    if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
        return "bad_tokens", "token_ids must be a list of ints (the engine's ids, not text)"
    if not ids:
        return "empty", "token_ids is empty"
    if vocab_size is not None and (min(ids) < 0 or max(ids) >= vocab_size):
        return "bad_tokens", f"token_ids has ids outside [0, {vocab_size}) (the tokenizer's vocabulary)"
    if not isinstance(mask, list) or len(mask) != len(ids):
        n = len(mask) if isinstance(mask, list) else type(mask).__name__
        return "bad_mask", f"loss_mask has {n} entries for {len(ids)} token_ids"
    if any(m not in (0, 1) for m in mask):  # 0/1, True/False or 0.0/1.0
        return "bad_mask", "loss_mask entries must be 0 or 1"
    policy = [i for i, m in enumerate(mask) if m]
    if not policy:
        return "empty", "loss_mask has no 1: no token of the policy to train on"
    lps, vs = res.logprobs, res.versions
    if not isinstance(lps, list) or len(lps) != len(ids):
        n = len(lps) if isinstance(lps, list) else type(lps).__name__
        return "missing_logprobs", f"logprobs has {n} entries for {len(ids)} token_ids"
    bad = next((i for i in policy if not finite(lps[i])), None)
    if bad is not None:
        return "missing_logprobs", f"logprobs[{bad}] = {lps[bad]!r} on a policy token (loss_mask 1)"
    if not isinstance(vs, list) or len(vs) != len(ids):
        n = len(vs) if isinstance(vs, list) else type(vs).__name__
        return "missing_versions", f"versions has {n} entries for {len(ids)} token_ids"
    bad = next((i for i in policy if not _is_int(vs[i]) or vs[i] < 0), None)
    if bad is not None:
        return "missing_versions", f"versions[{bad}] = {vs[bad]!r} on a policy token (an int >= 0 expected)"
    if max_tokens is not None and prompt_len + len(ids) > max_tokens:
        return "too_long", (f"prompt + token_ids = {prompt_len + len(ids)} tokens > {max_tokens} (the servers' "
                            f"context or train.micro_batch_tokens); stop the episode earlier")
    if res.reward is not None and not finite(res.reward):
        return "bad_result", f"reward = {res.reward!r} is not a finite number (or None)"
    try:
        json.dumps(res.metadata)
    except (TypeError, ValueError) as e:
        return "bad_result", f"metadata is not JSON-serialisable ({e}); checkpoints keep it"
    return None, ""


def normalised(res: RolloutResult) -> RolloutResult:
    """Plain lists; the environment's tokens get log-prob 0.0 and version -1 (never read)."""
    mask = [int(m) for m in res.loss_mask]
    return RolloutResult(token_ids=[int(t) for t in res.token_ids], loss_mask=mask,
                         logprobs=[float(x) if m else 0.0 for x, m in zip(res.logprobs, mask)],
                         versions=[int(v) if m else -1 for v, m in zip(res.versions, mask)],
                         reward=None if res.reward is None else float(res.reward),
                         finish_reason=res.finish_reason, metadata=dict(res.metadata),
                         routed_experts=res.routed_experts)


class EpisodeLog:
    """ctx.log for one group: numbers per name, averaged per step as rollout/custom/<name>."""

    def __init__(self):
        self.values: dict[str, list[float]] = {}

    def __call__(self, **metrics) -> None:
        for k, v in metrics.items():
            if not finite(v):
                raise ValueError(f"ctx.log({k}={v!r}): values must be finite numbers")
            self.values.setdefault(k, []).append(float(v))


class RolloutRunner:
    """Calls one rollout function per group and keeps the counters of what came back (thread-safe: groups run
    on the client's loop, stats() is read by the training loop)."""

    def __init__(self, fn: Callable, name: str, *, tokenizer, sampling: dict, n: int,
                 timeout_s: Optional[float], score: Callable[..., float], routed_experts: bool = False,
                 vocab_size: Optional[int] = None, max_tokens: Optional[int] = None, tool_parser=None,
                 args: Optional[dict] = None, fail_limit: int = 0, max_context: int = 0, evaluation: bool = False):
        """score(text, row, token_ids=None): the recipe's reward (blocking; run in a thread). fail_limit:
        samples (a first step's worth) after which a run with no usable episode yet stops (0: never)."""
        self.fn, self.name, self.tok, self.sampling, self.n = fn, name, tokenizer, sampling, n
        self.timeout_s, self.score, self.routed = timeout_s, score, routed_experts
        self.vocab_size, self.max_tokens, self.tool_parser = vocab_size, max_tokens, tool_parser
        self.args, self.fail_limit, self.max_context = dict(args or {}), fail_limit, max_context
        self.evaluation = evaluation
        self.lock = threading.Lock()
        self.dropped: Counter = Counter()  # since the last stats()
        self.custom: dict[str, list[float]] = {}
        self.calls = self.groups = self.policy_tokens = self.env_tokens = 0
        self.ok_total = self.failed_total = 0
        self.failures: Counter = Counter()  # every problem of the run, for the first-step stop's message
        self.first_detail: dict[str, str] = {}
        self.warned: Counter = Counter()  # printed lines per problem

    def context(self, client, row: dict, prompt_ids: list[int], seed: int, group_id: str, n: int) -> tuple:
        gc = GroupClient(client, self.routed)
        log = EpisodeLog()

        async def reward(text: str, token_ids: Optional[list[int]] = None) -> float:
            call = functools.partial(self.score, text, dict(row), token_ids)
            return float(await asyncio.get_running_loop().run_in_executor(None, call))

        ctx = RolloutContext(row=dict(row), prompt_ids=list(prompt_ids), tokenizer=self.tok,
                             sampling_params=dict(self.sampling), n=n, seed=seed, client=gc, reward=reward,
                             log=log, group_id=group_id, max_context=self.max_context,
                             tool_parser=self.tool_parser, args=dict(self.args), evaluation=self.evaluation)
        return ctx, gc, log

    async def run_group(self, client, row: dict, prompt_ids: list[int], seed: int, group_id: str,
                        n: Optional[int] = None) -> list[Episode]:
        """The group's n Episodes (n: the runner's, or an eval set's n_samples)."""
        n = n or self.n
        ctx, gc, log = self.context(client, row, prompt_ids, seed, group_id, n)
        task = asyncio.ensure_future(self.fn(ctx))
        task.add_done_callback(_retrieve)  # a task abandoned at its timeout must not warn at shutdown
        done, _ = await asyncio.wait({task}, timeout=self.timeout_s)
        if not done:
            task.cancel()
            eps = self._all(group_id, n, "timeout",
                            f"the call ran past rollout.function_timeout_s = {self.timeout_s} s")
        elif isinstance(task.exception(), ServerUnavailable):
            raise task.exception()  # every server down past its restarts: the run stops, as without plug-ins
        elif task.exception() is not None:
            e = task.exception()
            eps = self._all(group_id, n, "error", f"raised {type(e).__name__}: {e}")
        else:
            eps = self._judge(group_id, n, task.result(), len(prompt_ids))
        self._account(eps, gc, log)
        for e in eps:
            e.server = gc.server or ""
        return eps

    def _all(self, gid: str, n: int, problem: str, detail: str) -> list[Episode]:
        return [Episode(None, problem, f"group {gid}: {detail}") for _ in range(n)]

    def _judge(self, gid: str, n: int, results, prompt_len: int) -> list[Episode]:
        if not isinstance(results, (list, tuple)) or len(results) != n:
            got = f"{len(results)} results" if isinstance(results, (list, tuple)) else f"a {type(results).__name__}"
            return self._all(gid, n, "bad_result", f"returned {got}; expected a list of ctx.n = {n} RolloutResult")
        out = []
        for i, res in enumerate(results):
            problem, detail = check_result(res, vocab_size=self.vocab_size, max_tokens=self.max_tokens,
                                           prompt_len=prompt_len)
            out.append(Episode(None, problem, f"group {gid} sample {i}: {detail}") if problem
                       else Episode(normalised(res)))
        return out

    def _account(self, eps: list[Episode], gc: GroupClient, log: EpisodeLog) -> None:
        bad = [e for e in eps if e.problem]
        usable = [e.result for e in eps if e.result is not None and e.result.finish_reason != "abort"]
        with self.lock:
            self.groups += 1
            self.calls += gc.calls
            for k, v in log.values.items():
                self.custom.setdefault(k, []).extend(v)
            for r in usable:
                p = sum(r.loss_mask)
                self.policy_tokens += p
                self.env_tokens += len(r.loss_mask) - p
            self.ok_total += len(usable)
            self.failed_total += len(bad)
            for e in bad:
                self.dropped[e.problem] += 1
                self.failures[e.problem] += 1
                self.first_detail.setdefault(e.problem, e.detail)
            shown = set()  # a group-level problem has one detail for its n samples: said once
            for e in bad:
                if e.problem == "rejected" or (e.problem, e.detail) in shown:  # rejected: on purpose
                    continue
                shown.add((e.problem, e.detail))
                self.warned[e.problem] += 1
                if self.warned[e.problem] <= WARN_PER_PROBLEM:
                    more = " (later ones only counted: rollout_fn/dropped/*)" if (
                        self.warned[e.problem] == WARN_PER_PROBLEM) else ""
                    print(f"[m2po] rollout.function {self.name!r}: dropped ({e.problem}): {e.detail}{more}",
                          flush=True)
            stop = self.fail_limit and not self.ok_total and self.failed_total >= self.fail_limit
        if stop:
            reasons = "; ".join(f"{k} x{v}: {self.first_detail[k]}" for k, v in self.failures.most_common())
            raise RolloutFunctionFailed(
                f"rollout.function {self.name!r}: every episode of the first step failed ({self.failed_total} "
                f"samples, none usable): {reasons}. Fix the function (docs/agents.md) and start again")

    def stats(self) -> dict:
        """rollout_fn/* and rollout/custom/* since the previous call."""
        with self.lock:
            dropped, self.dropped = self.dropped, Counter()
            custom, self.custom = self.custom, {}
            calls, groups, self.calls, self.groups = self.calls, self.groups, 0, 0
            pt, et, self.policy_tokens, self.env_tokens = self.policy_tokens, self.env_tokens, 0, 0
        out = {f"rollout_fn/dropped/{k}": v for k, v in dropped.items()}
        if groups:
            out["rollout_fn/generate_calls_per_group"] = calls / groups
        if pt + et:
            out["rollout_fn/env_token_frac"] = et / (pt + et)
        out.update({f"rollout/custom/{k}": sum(v) / len(v) for k, v in custom.items() if v})
        return out


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


def sampling_params(cfg) -> dict:
    """SGLang sampling_params of every training request (the runner adds the per-group seed)."""
    r = cfg.rollout
    return {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k, "max_new_tokens": r.max_new_tokens}


def runner_for(cfg, tokenizer, score, routed_experts: bool = False, *, function_key: str = "rollout.function",
                sampling: Optional[dict] = None, fail_limit: Optional[int] = None):
    """The recipe's rollout function (rollout.function, or eval.function for evaluation) behind its runner:
    results checked against the model's vocabulary and the longest sequence the trainer and servers take."""
    from m2po_megatron.agents.loader import load_rollout_function, load_tool_parser
    from m2po_megatron.models.hf_config import read_hf_config

    r, t = cfg.rollout, cfg.train
    spec = cfg.eval.get("function") if function_key == "eval.function" else None
    fn, name = load_rollout_function(spec or r.get("function"), function_key if spec else "rollout.function")
    hf = read_hf_config(cfg.model.hf_path or cfg.model.hf_config)
    context = r.context_length or hf.max_position_embeddings
    return RolloutRunner(fn, name, tokenizer=tokenizer, sampling=sampling or sampling_params(cfg),
                         n=r.n_samples_per_prompt, timeout_s=r.get("function_timeout_s"), score=score,
                         routed_experts=routed_experts, vocab_size=hf.vocab_size,
                         max_tokens=min(t.micro_batch_tokens, context), tool_parser=load_tool_parser(
                             r.get("tool_call_parser")), args=_plain(r.get("function_args")),
                         fail_limit=t.prompts_per_step * r.n_samples_per_prompt if fail_limit is None else fail_limit,
                         max_context=context, evaluation=function_key == "eval.function")


def _plain(args) -> dict:
    """rollout.function_args as plain dicts and lists (the recipe's are OmegaConf's containers)."""
    from omegaconf import DictConfig, OmegaConf

    return OmegaConf.to_container(args, resolve=True) if isinstance(args, DictConfig) else dict(args or {})
