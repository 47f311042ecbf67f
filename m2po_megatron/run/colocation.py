"""The colocated swap from the driver (cluster.colocate; docs/colocate.md): the rollout engines and the trainer
ranks share the same GPUs and take turns.

    generate phase: engines hold weights + KV cache + CUDA graphs; the trainer's state is on the host
    to_train():     engines release everything (SGLang's release_memory_occupation), the trainer reloads
    train phase:    the trainer trains (and saves checkpoints, and recomputes behaviour log-probs)
    to_generate(v): engines resume their weights' memory, the trainer's ranks update them from tensors on the
                    same GPU (the WeightUpdater's push, so its synced version and restart handling stay), the
                    trainer offloads, engines resume KV cache and CUDA graphs

Each verb returns its phases' seconds under the metric names `time/colocate/*` (and `time/weight_sync` for
the update) and writes the same phases as trace spans of category "colocate", which the planner's colocated
model is calibrated from. A failure inside a swap stops the run with a RunError naming the phase; the loop's
clean-up then ends every process of the run."""
from __future__ import annotations

import concurrent.futures
import contextlib
import time

from omegaconf import DictConfig

from m2po_megatron.infra import trace


class Colocation:
    """`trainers`: run/trainers.Ranks; `weights`: rollout/updates.WeightUpdater (connected); `urls` the engines."""

    def __init__(self, cfg: DictConfig, trainers, weights, urls: list[str], api_key: str | None):
        self.trainers, self.weights, self.urls, self.api_key = trainers, weights, urls, api_key
        self.timeout_s = cfg.rollout.request_timeout_s
        self.phase = "generate"  # the trainer was offloaded before the engines started
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(2, len(urls)),
                                                           thread_name_prefix="colocate")
        trainers.on_device = self.on_device  # trainer recomputation of behaviour log-probs swaps too

    def to_train(self) -> dict:
        """Engines give back every GPU byte; the trainer reloads its state."""
        from m2po_megatron.rollout.memory_occupation import TAGS_ALL, release_memory

        self._expect("generate", "to_train")
        out = {"time/colocate/release": self._engines("release", release_memory, TAGS_ALL)}
        out["time/colocate/reload"] = self._trainer("reload", self.trainers.reload)
        self.phase = "train"
        return out

    def to_generate(self, version: int) -> dict:
        """Engines take their weights' memory back and get `version` from the trainer, which then offloads;
        the engines take back KV cache and CUDA graphs. Returns the timings and the update's stats."""
        from m2po_megatron.rollout.memory_occupation import KV, WEIGHTS, resume_memory

        self._expect("train", "to_generate")
        out = {"time/colocate/resume_weights": self._engines("resume_weights", resume_memory, WEIGHTS)}
        t0 = time.perf_counter()
        # The WeightUpdater's push: its synced version stays the engines'. Its restart recovery waits on
        # /health_generate, which a released engine refuses; an engine that restarted mid-run holds its whole
        # memory and refuses the next resume, which stops the run here (docs/colocate.md, Faults).
        stats = self._checked("weight_sync", lambda: self.weights.push(version))
        out["time/weight_sync"] = time.perf_counter() - t0
        out["time/colocate/offload"] = self._trainer("offload", self.trainers.offload)
        out["time/colocate/resume_kv"] = self._engines("resume_kv", resume_memory, KV)
        self.phase = "generate"
        return {**stats, **out}

    @contextlib.contextmanager
    def on_device(self):
        """A block that needs the trainer on the GPU outside the train phase (a checkpoint's save, behaviour
        log-probs): a whole swap around it; the engines get back the weights they held."""
        if self.phase == "train":
            yield
            return
        self.to_train()
        try:
            yield
        finally:
            if self.phase == "train":
                self.to_generate(self.weights.synced)

    # -- the phases ---------------------------------------------------------------------------------------
    def _expect(self, phase: str, verb: str) -> None:
        if self.phase != phase:
            raise RuntimeError(f"colocation: {verb} in the {self.phase} phase (expected {phase})")

    def _engines(self, name: str, call, tags) -> float:
        """`call(url, key, tags, timeout)` on every engine at once; the phase's seconds."""
        def all_engines():
            futs = [self._pool.submit(call, u, self.api_key, tags, self.timeout_s) for u in self.urls]
            errors = [str(f.exception()) for f in futs if f.exception() is not None]
            if errors:
                raise RuntimeError("; ".join(errors))
        return self._timed(name, all_engines)

    def _trainer(self, name: str, call) -> float:
        return self._timed(name, call)

    def _timed(self, name: str, fn) -> float:
        t0 = time.perf_counter()
        self._checked(name, fn)
        t1 = time.perf_counter()
        trace.complete(name, "colocate", t0, t1, tid="loop")
        return t1 - t0

    def _checked(self, name: str, fn):
        """fn(), a failure becoming a RunError naming the phase (a RunError of the ranks passes as it is)."""
        import ray

        from m2po_megatron.infra.errors import RunError
        from m2po_megatron.run.checkpoint import resume_hint

        try:
            return fn()
        except RunError:
            raise
        except (RuntimeError, OSError, ray.exceptions.RayError) as e:
            cause = getattr(e, "cause", None) or e
            raise RunError(f"the colocated swap failed at {name} ({type(cause).__name__}: "
                           f"{str(cause).strip().splitlines()[-1] if str(cause).strip() else ''}); the run stops "
                           f"and its engines and trainer ranks are ended. {resume_hint(self.trainers.ckpts)}") from e

    def close(self) -> None:
        self._pool.shutdown(wait=False)
