"""Batched math-verify rewards in worker processes with a hard per-item time limit.

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

from .math_verify_reward import CORRECT, ERROR, NO_ANSWER, WRONG


@dataclass
class RewardStats:
    n: int = 0
    correct: int = 0
    wrong: int = 0
    no_answer: int = 0
    timeouts: int = 0
    errors: int = 0
    worker_restarts: int = 0
    seconds: float = 0.0

    def as_dict(self, prefix: str = "reward/") -> dict[str, float]:
        return {prefix + k: v for k, v in asdict(self).items()}


class _Worker:
    def __init__(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "m2po_megatron.reward.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            bufsize=0,
        )
        os.set_blocking(self.proc.stdout.fileno(), False)
        self.buf = b""
        self.ready = False
        self.inflight: deque[int] = deque()  # indices sent, in order; the head is being scored
        self.deadline = 0.0  # for the head item

    def send(self, idx: int, response: str, answer: str, format_score: float, timeout_s: float) -> None:
        if not self.inflight:
            self.deadline = time.monotonic() + timeout_s
        self.inflight.append(idx)
        self.proc.stdin.write((json.dumps([idx, response, answer, format_score]) + "\n").encode())

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


class RewardPool:
    """``RewardPool(num_workers, timeout_s, format_score)``; ``score(responses, answers) -> (scores, stats)``.

    ``timeout_s`` bounds each item's scoring time (from when its worker starts on it: the previous item's
    answer); ``start_timeout_s`` bounds a worker's start-up (imports), after which scoring fails loudly.
    ``prefetch`` items are queued per worker so it never waits for the parent between items.
    """

    def __init__(self, num_workers: int = 2, timeout_s: float = 10.0, format_score: float = 0.0,
                 start_timeout_s: float = 120.0, prefetch: int = 4) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.num_workers, self.timeout_s, self.format_score = num_workers, float(timeout_s), float(format_score)
        self.start_timeout_s = start_timeout_s
        self.prefetch = max(1, int(prefetch))
        self.total = RewardStats()  # over the pool's lifetime
        self._sel = selectors.DefaultSelector()
        self._workers: list[_Worker] = []
        self._closed = False
        for _ in range(num_workers):
            self._spawn()

    def _spawn(self) -> _Worker:
        w = _Worker()
        w.started = time.monotonic()
        self._sel.register(w.proc.stdout, selectors.EVENT_READ, w)
        self._workers.append(w)
        return w

    def _retire(self, w: _Worker) -> None:
        self._sel.unregister(w.proc.stdout)
        self._workers.remove(w)
        w.kill()

    def score(self, responses: list[str], answers: list[str]) -> tuple[list[float], RewardStats]:
        if self._closed:
            raise RuntimeError("RewardPool is closed")
        if len(responses) != len(answers):
            raise ValueError(f"responses ({len(responses)}) and answers ({len(answers)}) differ in length")
        t0 = time.monotonic()
        stats = RewardStats(n=len(responses))
        scores = [0.0] * len(responses)
        pending = list(range(len(responses)))[::-1]  # pop() takes the lowest index first
        remaining = len(responses)
        counters = {CORRECT: "correct", WRONG: "wrong", NO_ANSWER: "no_answer", ERROR: "errors"}

        def replace(w: _Worker) -> None:
            self._retire(w)
            self._spawn()
            stats.worker_restarts += 1

        while remaining:
            now = time.monotonic()
            # spread pending items round-robin so every worker gets work before any gets a deep queue
            for depth in range(1, self.prefetch + 1):
                for w in list(self._workers):
                    if w.ready and len(w.inflight) < depth and pending:
                        i = pending.pop()
                        try:
                            w.send(i, responses[i], answers[i], self.format_score, self.timeout_s)
                        except (BrokenPipeError, OSError):  # it died: its items go back to the queue
                            w.inflight.pop()
                            pending.extend(reversed(w.inflight))
                            w.inflight.clear()
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
                        w.inflight.popleft()
                        stats.errors += 1
                        remaining -= 1
                        pending.extend(reversed(w.inflight))  # the queued ones are retried elsewhere
                        w.inflight.clear()
                    elif not w.ready:
                        raise RuntimeError("a reward worker exited during start-up; run "
                                           "`python -m m2po_megatron.reward.worker` to see why")
                    replace(w)
                    continue
                for m in msgs:
                    if m == "ready":
                        w.ready = True
                        continue
                    idx, s, status = m[0], m[1], m[2]
                    if not w.inflight or idx != w.inflight[0]:
                        continue  # not an item this worker owes (cannot happen with an ordered pipe)
                    w.inflight.popleft()
                    w.deadline = time.monotonic() + self.timeout_s  # the next queued item starts now
                    scores[idx] = float(s)
                    setattr(stats, counters[status], getattr(stats, counters[status]) + 1)
                    remaining -= 1
            now = time.monotonic()
            for w in list(self._workers):
                if w.inflight and now >= w.deadline:
                    w.inflight.popleft()  # its score stays 0
                    stats.timeouts += 1
                    remaining -= 1
                    pending.extend(reversed(w.inflight))  # queued items behind it are retried elsewhere
                    w.inflight.clear()
                    replace(w)
                elif not w.ready and now - w.started > self.start_timeout_s:
                    self.close()
                    raise RuntimeError(f"a reward worker did not start within {self.start_timeout_s} s")
        stats.seconds = time.monotonic() - t0
        for k, v in asdict(stats).items():
            setattr(self.total, k, getattr(self.total, k) + v)
        return scores, stats

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
