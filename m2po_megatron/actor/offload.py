"""The trainer's side of colocation (docs/colocate.md): its weights, gradients and optimizer state leave the GPU
while the rollout engines generate on it, and come back for training.

On a GPU this is torch_memory_saver's pause and resume of a tagged region, the library SGLang and slime use:
everything the trainer allocates inside `region()` (the model, its gradient buffers, the optimizer state,
which Adam creates at its first step, and the activations' cached blocks) is backed up to pinned host memory
and its device memory given back at `offload()`, then mapped again and restored at `reload()`. megatron-core
0.19 has no offload of a model's state of its own (its CPU offloading is of activations, or of the optimizer's
step), so the kept library is torch_memory_saver. Its "torch" hook mode (a PyTorch memory pool with its
allocator) needs no LD_PRELOAD of the trainer's process.

On CPU (no device memory) there is nothing to move: offload and reload are no-ops that still report their
time and bytes (about 0), so a CPU run exercises the protocol and its metrics."""
from __future__ import annotations

import contextlib
import gc
import time

TAG = "m2po_trainer"  # the trainer's region; SGLang's own tags (kv_cache, weights, cuda_graph) are the engine's


class Offloader:
    """`enabled`: colocated on a GPU. Use `region()` around everything that allocates the trainer's state, then
    `offload()` / `reload()`. `on_device()`: a block that needs the state (a checkpoint's save or load) reloads
    it first if it was offloaded, and offloads it again after."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.offloaded = False
        self._saver = None
        if enabled:
            try:
                from torch_memory_saver import torch_memory_saver
            except ImportError as e:
                raise RuntimeError("cluster.colocate on GPUs needs torch_memory_saver in the trainer's environment "
                                   "(pip install torch_memory_saver, the version SGLang pins)") from e
            torch_memory_saver.hook_mode = "torch"  # before its first use: no LD_PRELOAD needed
            self._saver = torch_memory_saver

    @contextlib.contextmanager
    def region(self):
        # Checked on CPU too, where nothing moves: a loop that computes between offload and reload fails in CI,
        # not first on a GPU, where it would read unmapped memory.
        if self.offloaded:
            raise RuntimeError("the trainer's state is offloaded; reload() it before computing")
        if self._saver is None:
            yield
            return
        with self._saver.region(tag=TAG, enable_cpu_backup=True):
            yield

    def offload(self) -> dict:
        """Give the trainer's device memory back (its content kept on the host). Returns seconds and bytes."""
        t0 = time.perf_counter()
        freed = 0
        if self._saver is not None and not self.offloaded:
            import torch

            gc.collect()
            torch.cuda.synchronize()
            before = torch.cuda.mem_get_info()[0]
            self._saver.pause(TAG)
            torch.cuda.synchronize()
            freed = torch.cuda.mem_get_info()[0] - before
        self.offloaded = True
        return {"seconds": time.perf_counter() - t0, "bytes": max(freed, 0)}

    def reload(self) -> dict:
        """Map the trainer's device memory again and restore its content. Returns seconds and bytes."""
        t0 = time.perf_counter()
        taken = 0
        if self._saver is not None and self.offloaded:
            import torch

            before = torch.cuda.mem_get_info()[0]
            self._saver.resume(TAG)
            torch.cuda.synchronize()
            taken = before - torch.cuda.mem_get_info()[0]
        self.offloaded = False
        return {"seconds": time.perf_counter() - t0, "bytes": max(taken, 0)}

    @contextlib.contextmanager
    def on_device(self):
        """The state on the device for the block (a checkpoint while offloaded), then back where it was."""
        was = self.offloaded
        if was:
            self.reload()
        try:
            with self.region():
                yield
        finally:
            if was:
                self.offload()
