"""Lets megatron-core 0.19.x run on CPU over gloo by mapping its CUDA device to the CPU, and nothing else. Active
only when CUDA is absent; nothing else knows about it.

megatron-core assumes a GPU in a handful of places (docs/models.md, "megatron-core on CPU"): tensors allocated with
`device="cuda"` / `torch.cuda.current_device()` / `.cuda()`, the CUDA RNG tracker, `torch.cuda.synchronize`,
streams and events in DDP grad sync, `param.type() == 'torch.cuda.FloatTensor'` checks in the optimizer, and the
MoE dispatcher's `tensor.is_cuda` test before its device-to-host copy of split sizes.
On a machine without CUDA the CPU *is* the device, so this module:

1. pushes a `TorchFunctionMode` that rewrites CUDA devices (strings, `torch.device`, integer indices) to CPU,
   turns `.cuda()` / `pin_memory()` / `record_stream()` into no-ops and makes the no-argument `Tensor.type()`
   report `torch.cuda.*` (the mode is per thread: see `cpu_mode()`);
2. replaces the process-wide `torch.cuda` entry points megatron calls (current_device, synchronize, streams,
   events, RNG state, memory counters) with CPU equivalents; `torch.cuda.Stream`/`Event` stay classes because
   transformers evaluates `torch.cuda.Stream | None` at import time;
3. makes megatron's RNG tracker keep CPU generator states (the "device" generator is the CPU generator; its
   fork is megatron's, less the warning that the CPU state changed, which on CPU it always does).

Everything that is not device mapping runs on every device and lives elsewhere: e.g. resuming torch's AdamW
under the distributed optimizer is `actor/torch_adam.py`, the norm dtype and fusion choices are models/builder.py.

Usage: call `activate()` once per process before building Megatron models (m2po_megatron.actor.parallel does
it), and wrap work in other threads in `with cpu_mode():`.
"""
from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

from m2po_megatron.infra.device import has_cuda

_lock = threading.Lock()
_patched = False  # process-wide patches applied
_tls = threading.local()  # per-thread: the mode object pushed in this thread


def _is_cuda_device(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return False


def _to_cpu_device(dev):
    if _is_cuda_device(dev) or (isinstance(dev, int) and not isinstance(dev, bool)):
        return torch.device("cpu")
    return dev


_TENSOR_TYPE = torch.Tensor.type
_TENSOR_TO = torch.Tensor.to
_NOOP_RETURN_SELF = {torch.Tensor.cuda, torch.Tensor.pin_memory}
_RECORD_STREAM = torch.Tensor.record_stream


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites every CUDA device argument to CPU; see module docstring."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs) if kwargs else {}
        if func in _NOOP_RETURN_SELF:
            return args[0]
        if func is _RECORD_STREAM:
            return None
        if func is _TENSOR_TYPE and len(args) == 1 and not kwargs:
            name = func(*args)
            # 'torch.FloatTensor' -> 'torch.cuda.FloatTensor' (megatron optimizer checks this string)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is _TENSOR_TO and len(args) > 1:
            args = (args[0], _to_cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)


class _DummyStream:
    """Stands in for torch.cuda.Stream on CPU: every operation is already ordered, so all are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, event=None):
        return event if event is not None else _DummyEvent()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    @staticmethod
    def priority_range():
        return (0, 0)


class _DummyEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _patch_process() -> None:
    """Process-wide replacements of torch.cuda entry points and megatron's RNG tracker."""
    global _patched
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.synchronize = lambda *a, **k: None
    cuda.set_device = lambda *a, **k: None
    cuda.Stream = _DummyStream
    cuda.ExternalStream = _DummyStream
    cuda.Event = _DummyEvent
    cuda.current_stream = lambda *a, **k: _DummyStream()
    cuda.default_stream = lambda *a, **k: _DummyStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.set_stream = lambda *a, **k: None
    cuda.is_current_stream_capturing = lambda: False
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(cuda, name, lambda *a, **k: 0)
    cuda.memory_stats = lambda *a, **k: {}
    cuda.empty_cache = lambda: None
    # On CPU the "device" generator is the CPU generator.
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed)) and None
    cuda.manual_seed_all = lambda seed: None  # torch.manual_seed calls this after seeding the CPU generator
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state

    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)

    base = mrandom.CudaRNGStatesTracker
    if not getattr(base, "_m2po_cpu", False):

        class CPURNGStatesTracker(base):
            """Megatron's tracker over CPU generator states, without the 'CPU RNG state changed' warning
            (on CPU the tracked generator and the CPU generator are the same one)."""

            _m2po_cpu = True

            def __init__(self, *args, **kwargs):
                kwargs["use_cudagraphable_rng"] = False
                super().__init__(*args, **kwargs)

            @contextlib.contextmanager
            def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
                if name not in self.states_:
                    raise Exception(f"rng state {name} is not added")
                orig = torch.get_rng_state()
                torch.set_rng_state(self.states_[name])
                prev_name, self._current_state_name = self._current_state_name, name
                try:
                    yield
                finally:
                    self.states_[name] = torch.get_rng_state()
                    torch.set_rng_state(orig)
                    self._current_state_name = prev_name

        mrandom.CudaRNGStatesTracker = CPURNGStatesTracker
        # A tracker built before activation would hold the CUDA class; rebuild it on next use.
        if mrandom._CUDA_RNG_STATE_TRACKER is not None and not isinstance(
            mrandom._CUDA_RNG_STATE_TRACKER, CPURNGStatesTracker
        ):
            mrandom._CUDA_RNG_STATE_TRACKER = None
            mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    _patch_moe_host_copy()
    _patched = True


def _patch_moe_host_copy() -> None:
    """The MoE all-to-all dispatcher copies its split sizes from the device to the host (as numpy, which the
    collective takes) only when `tensor.is_cuda`; here the device is the CPU, so a device tensor is a CPU
    tensor: the same copy, keyed on the mapped device instead."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu
    if getattr(original, "_m2po_cpu", False):
        return

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy() if as_numpy else tensor
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    maybe_move_tensor_to_cpu._m2po_cpu = True
    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _enter_thread_mode() -> None:
    if getattr(_tls, "mode", None) is None:
        mode = _CudaToCpuMode()
        mode.__enter__()
        _tls.mode = mode


def activate() -> bool:
    """Turn the layer on for this process and the calling thread. Idempotent. Returns whether it is active
    (False, and nothing is changed, when CUDA is present)."""
    if has_cuda():
        return False
    with _lock:
        if not _patched:
            _patch_process()
    _enter_thread_mode()
    return True


@contextlib.contextmanager
def cpu_mode():
    """Run a block of Megatron code in any thread (the device mode is thread-local). No-op with CUDA."""
    if has_cuda():
        yield
        return
    with _lock:
        if not _patched:
            _patch_process()
    if getattr(_tls, "mode", None) is not None:
        yield  # already active in this thread
        return
    with _CudaToCpuMode():
        yield
