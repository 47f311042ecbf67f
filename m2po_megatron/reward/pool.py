"""Reward functions run in worker processes with a hard per-item time limit (any function of the reward
registry: math-verify, the sandboxed code reward, a user's `reward.function`).

Each worker is a separate Python process (``python -m m2po_megatron.reward.worker``) talking JSON lines over
pipes, so the pool works the same from a script without a ``__main__`` guard, a Ray actor or a thread, and
never forks a process that holds torch threads. An item that runs past ``timeout_s`` scores 0, is counted,
and its worker is killed (SIGKILL: sympy's big-integer arithmetic ignores Python signals) and replaced.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass

from .types import RewardInput, RewardOutput


@dataclass
class RewardStats:
    n: int = 0
    timeouts: int = 0
    errors: int = 0  # the function raised, or its worker died on the item
    bad_values: int = 0  # it returned something that is not a reward (types.normalize)
    worker_restarts: int = 0
    seconds: float = 0.0

    def as_dict(self, prefix: str = "reward/") -> dict[str, float]:
        return {prefix + k: v for k, v in asdict(self).items()}


class _Worker:
    def __init__(self, header: bytes) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "m2po_megatron.reward.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            bufsize=0,
        )
        self.proc.stdin.write(header)  # the functions to import; it answers "ready" once they are
        os.set_blocking(self.proc.stdout.fileno(), False)
        self.buf = b""
        self.ready = False
        self.inflight: deque[tuple[int, float]] = deque()  # (index, time limit) sent, in order; the head is being scored
        self.deadline = 0.0  # for the head item

    def send(self, idx: int, fi: int, item: RewardInput, timeout_s: float) -> None:
        if not self.inflight:
            self.deadline = time.monotonic() + timeout_s
        self.inflight.append((idx, timeout_s))
        line = json.dumps([idx, fi, item.response, list(item.token_ids), item.row], default=str)
        self.proc.stdin.write((line + "\n").encode())

    def read_messages(self) -> list | None:
        """Complete messages available now; None when the worker has exited (EOF)."""
        try:
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
        except BlockingIOError:
            return []
        if not chunk:
            return None
        self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


MATH_VERIFY = ("m2po_megatron.reward.math_verify_reward:math_verify_fn", {})


class RewardPool:
    """``RewardPool(functions, num_workers, timeout_s)``; ``score(jobs) -> (outputs, stats)``.

    ``functions``: ``[(target, args)]``, import paths as reward/functions.py resolves them, each called as
    ``fn(response, token_ids, row, **args)``; a job is ``(function_index, RewardInput)`` (or a bare RewardInput
    for function 0). ``timeout_s`` bounds each item's scoring time (from when its worker starts on it: the
    previous item's answer), per function when ``timeouts`` gives one; ``start_timeout_s`` bounds a worker's
    start-up (imports), after which scoring fails loudly. ``prefetch`` items are queued per worker so it never
    waits for the parent between items.
    """

    def __init__(self, functions: list[tuple[str, dict]] | None = None, num_workers: int = 2,
                 timeout_s: float = 10.0, start_timeout_s: float = 120.0, prefetch: int = 4,
                 timeouts: list[float | None] | None = None) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.functions = [(str(t), dict(a)) for t, a in (functions or [MATH_VERIFY])]
        self.num_workers, self.timeout_s = num_workers, float(timeout_s)
        self.timeouts = [float(t) if t else self.timeout_s for t in (timeouts or [None] * len(self.functions))]
        self._header = (json.dumps({"functions": self.functions}) + "\n").encode()
        self.start_timeout_s = start_timeout_s
        self.prefetch = max(1, int(prefetch))
        self.total = RewardStats()  # over the pool's lifetime
        self._sel = selectors.DefaultSelector()
        self._workers: list[_Worker] = []
        self._closed = False
        for _ in range(num_workers):
            self._spawn()

    def _spawn(self) -> _Worker:
        w = _Worker(self._header)
        w.started = time.monotonic()
        self._sel.register(w.proc.stdout, selectors.EVENT_READ, w)
        self._workers.append(w)
        return w

    def _retire(self, w: _Worker) -> None:
        self._sel.unregister(w.proc.stdout)
        self._workers.remove(w)
        w.kill()

    def score(self, jobs: list) -> tuple[list[RewardOutput], RewardStats]:
        """One RewardOutput per job, in order: score None with status timeout, error (raised, or its worker
        died) or bad_value when the function gave no reward."""
        if self._closed:
            raise RuntimeError("RewardPool is closed")
        jobs = [j if isinstance(j, tuple) else (0, j) for j in jobs]
        for fi, _ in jobs:
            if not 0 <= fi < len(self.functions):
                raise ValueError(f"function index {fi} out of range ({len(self.functions)} functions)")
        t0 = time.monotonic()
        stats = RewardStats(n=len(jobs))
        outs: list[RewardOutput] = [RewardOutput(None, status="error") for _ in jobs]
        pending = list(range(len(jobs)))[::-1]  # pop() takes the lowest index first
        remaining = len(jobs)

        def replace(w: _Worker) -> None:
            self._retire(w)
            self._spawn()
            stats.worker_restarts += 1

        def requeue(w: _Worker) -> None:  # the items queued behind a failed one are retried elsewhere
            pending.extend(reversed([i for i, _ in w.inflight]))
            w.inflight.clear()

        while remaining:
            now = time.monotonic()
            # spread pending items round-robin so every worker gets work before any gets a deep queue
            for depth in range(1, self.prefetch + 1):
                for w in list(self._workers):
                    if w.ready and len(w.inflight) < depth and pending:
                        i = pending.pop()
                        fi, item = jobs[i]
                        try:
                            w.send(i, fi, item, self.timeouts[fi])
                        except (BrokenPipeError, OSError):  # it died: its items go back to the queue
                            w.inflight.pop()
                            requeue(w)
                            pending.append(i)
                            replace(w)
            busy = [w for w in self._workers if w.inflight]
            waits = [w.deadline - now for w in busy]
            waits += [w.started + self.start_timeout_s - now for w in self._workers if not w.ready]
            for key, _ in self._sel.select(timeout=max(0.0, min(waits)) if waits else 1.0):
                w = key.data
                msgs = w.read_messages()
                if msgs is None:  # the worker died (e.g. out of memory): its current item is an error
                    if w.inflight:
                        i, _ = w.inflight.popleft()
                        outs[i] = RewardOutput(None, status="error", detail="its reward worker died on it")
                        stats.errors += 1
                        remaining -= 1
                        requeue(w)
                    elif not w.ready:
                        self.close()
                        raise RuntimeError("a reward worker exited during start-up; run `python -m "
                                           "m2po_megatron.reward.worker` to see why")
                    replace(w)
                    continue
                for m in msgs:
                    if m == "ready":
                        w.ready = True
                        continue
                    if m[0] == "failed":
                        self.close()
                        raise RuntimeError(f"a reward worker could not load the reward functions: {m[1]}")
                    idx, score, extras, status, detail = m
                    if not w.inflight or idx != w.inflight[0][0]:
                        continue  # not an item this worker owes (cannot happen with an ordered pipe)
                    w.inflight.popleft()
                    if w.inflight:  # the next queued item starts now
                        w.deadline = time.monotonic() + w.inflight[0][1]
                    outs[idx] = RewardOutput(None if score is None else float(score), extras, status, detail)
                    if status == "error":
                        stats.errors += 1
                    elif status == "bad_value":
                        stats.bad_values += 1
                    remaining -= 1
            now = time.monotonic()
            for w in list(self._workers):
                if w.inflight and now >= w.deadline:
                    i, limit = w.inflight.popleft()
                    outs[i] = RewardOutput(None, status="timeout", detail=f"no verdict within {limit:g} s")
                    stats.timeouts += 1
                    remaining -= 1
                    requeue(w)
                    replace(w)
                elif not w.ready and now - w.started > self.start_timeout_s:
                    self.close()
                    raise RuntimeError(f"a reward worker did not start within {self.start_timeout_s} s")
        stats.seconds = time.monotonic() - t0
        for k, v in asdict(stats).items():
            setattr(self.total, k, getattr(self.total, k) + v)
        return outs, stats

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for w in list(self._workers):
            try:
                w.proc.stdin.close()  # EOF: the worker exits on its own
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for w in list(self._workers):
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            self._retire(w)
        self._sel.close()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
