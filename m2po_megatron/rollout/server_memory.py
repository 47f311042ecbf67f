"""The CPU server's memory-occupation endpoints, as SGLang 0.5.23 answers them, and the reader of the tensors
/update_weights_from_tensor carries. A mixin of LocalServer (local_server.py), which provides `engine`
and `_body`.

- POST /release_memory_occupation {tags}: tags null or [] = all of SGLang's (kv_cache, weights, cuda_graph).
  SGLang requires an idle server (nothing running; waiting requests count unless generation is paused); it
  asserts this inside its scheduler, which brings the server down, so here the call is refused (HTTP 400).
  Released tags are SGLang's offload_tags. A tag already released is refused too (torch_memory_saver refuses
  to pause a paused region), and an unknown tag (SGLang ignores it: refused here, it is a typo).
- POST /resume_memory_occupation {tags}: the same tags; resuming a tag that is not released is refused
  (SGLang's scheduler removes it from its set and fails). Resumed weights hold NaN until updated: SGLang
  does not restore them without --enable-weights-cpu-backup, which this server does not implement.
- Both answer SGLang's way: 200 with a null body, or 400 {"error": {"message"}}.
- While anything is released, or resumed weights still hold NaN (some parameter was not updated), generation
  (400) and /health_generate (503) are refused, naming the tags or parameters, and the engine takes no step
  (SGLang would compute with freed or stale GPU memory); /health answers 200 as SGLang's does (it generates
  nothing by default).
- The wire form of /update_weights_from_tensor is a pickle (torch's ForkingPickler, base64). It is read by an
  unpickler that resolves only the globals torch's CPU tensor and storage reductions need, so a crafted
  payload cannot run code; CUDA tensors (IPC handles) cannot be loaded here and are refused by name.
- Test-only fault injection (InjectedFaults, M2PO_CPU_SERVER_FAIL / M2PO_CPU_SERVER_HOLD): not SGLang's; unset,
  nothing changes."""
from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import io
import os
import pickle
from pathlib import Path

TAGS = ("kv_cache", "weights", "cuda_graph")  # SGLang's GPU_MEMORY_ALL_TYPES (srt/constants.py)

# Exactly what torch's reductions of a CPU tensor or parameter reference (torch/multiprocessing/reductions.py,
# file_system sharing: shared memory by name), plus the dtypes and torch.Size their arguments carry.
_ALLOWED = {("torch", "Tensor"), ("torch", "Size"), ("torch.nn.parameter", "Parameter"),
            ("torch.storage", "UntypedStorage"), ("torch", "UntypedStorage"),
            ("torch.multiprocessing.reductions", "rebuild_tensor"),
            ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
            ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
            ("torch.multiprocessing.reductions", "rebuild_typed_storage")}
_CUDA = {"rebuild_cuda_tensor", "_rebuild_cuda_tensor_modified"}


class _TensorUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        import torch

        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _CUDA:
            raise pickle.UnpicklingError("the payload holds CUDA tensors (IPC handles): the CPU server loads "
                                         "CPU tensors only; send tensors on the CPU")
        raise pickle.UnpicklingError(f"refused global {module}.{name}: only torch tensors and storages may be "
                                     "sent")


def load_named_tensors(payload: str) -> list[tuple[str, object]]:
    """One TP rank's serialized_named_tensors entry -> [(name, tensor)], or ValueError saying what is wrong."""
    import torch

    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError, TypeError) as e:
        raise ValueError(f"serialized_named_tensors[0] is not base64: {e}") from None
    try:
        named = _TensorUnpickler(io.BytesIO(raw)).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError, TypeError,
            RuntimeError) as e:
        raise ValueError(f"serialized_named_tensors[0] cannot be read: {e}") from None
    if not isinstance(named, (list, tuple)) or not all(
            isinstance(x, (list, tuple)) and len(x) == 2 and isinstance(x[0], str)
            and isinstance(x[1], torch.Tensor) for x in named):
        raise ValueError("serialized_named_tensors[0] must be MultiprocessingSerializer.serialize([(name, tensor), "
                         "...], output_str=True), a list of (str, torch.Tensor) pairs")
    return [(n, t) for n, t in named]


def _error(message: str, status: int = 400):
    from aiohttp import web

    return web.json_response({"error": {"message": message}}, status=status)  # SGLang's _create_error_response


class MemoryEndpoints:
    def released_error(self, what: str, status: int = 400):
        """The answer to `what` while memory is released or resumed weights were not all updated, or None."""
        if self.engine.released:
            return _error(f"{what} refused: GPU memory {sorted(self.engine.released)} is released; POST "
                          "/resume_memory_occupation with those tags first", status)
        nan = self.engine.nan_weights()
        if nan:
            return _error(f"{what} refused: {len(nan)} parameter(s) were not updated since the weights were resumed "
                          f"and hold NaN, e.g. {nan[:3]}; POST /update_weights_from_tensor with every parameter "
                          "first", status)
        return None

    async def _tags(self, request, endpoint: str) -> set[str] | str:
        body = await self._body(request, endpoint)
        tags = body.get("tags") or list(TAGS)
        unknown = sorted(set(tags) - set(TAGS))
        if unknown:
            return f"unknown tag(s) {unknown}; SGLang's tags are {list(TAGS)}"
        return set(tags)

    async def release_memory(self, request):
        from aiohttp import web

        tags = await self._tags(request, "POST /release_memory_occupation")
        if isinstance(tags, str):
            return _error(tags)
        injected = await self.faults.before("release_memory_occupation")
        if injected is not None:
            return injected
        # No waiting for running requests (SGLang's scheduler asserts idleness rather than waiting for it).
        stats = self.engine.stats()
        if not self.engine.idle(ignore_waiting=self.engine.paused):
            return _error("release_memory_occupation should be called only when server is idle "
                          f"({stats['running']} running, {stats['waiting']} waiting); pause generation or let "
                          "the requests finish first")
        again = sorted(tags & self.engine.released)
        if again:
            return _error(f"memory {again} is already released; resume it first")
        self.engine.release_memory(tags)
        return web.json_response(None)

    async def resume_memory(self, request):
        from aiohttp import web

        tags = await self._tags(request, "POST /resume_memory_occupation")
        if isinstance(tags, str):
            return _error(tags)
        injected = await self.faults.before("resume_memory_occupation")
        if injected is not None:
            return injected
        missing = sorted(tags - self.engine.released)
        if missing:
            return _error(f"memory {missing} is not released (released: {sorted(self.engine.released)}); resume "
                          "only what /release_memory_occupation released")
        self.engine.resume_memory(tags)
        return web.json_response(None)


# -- test-only fault injection ----------------------------------------------------------------------------
FAIL_ENV = "M2PO_CPU_SERVER_FAIL"  # "ROUTE:N": the N-th call of POST /ROUTE answers HTTP 500 and does nothing
HOLD_ENV = "M2PO_CPU_SERVER_HOLD"  # "ROUTE:N:DIR": the N-th call creates DIR/held, waits for DIR/go, then acts


class InjectedFaults:
    """Faults of the colocated swap at a known call, for tests (tests/faults/test_colocated_faults.py): this
    server stands in for SGLang, so a test can make a swap fail, or hold the driver inside one while it sends a
    signal, instead of racing the swap from outside. The variables reach the server through the run's
    environment (the launcher passes its own on); they are read once, when the server starts; unset, nothing
    changes. ROUTE is release_memory_occupation or resume_memory_occupation; N counts this server's calls of
    that route from 1 (a refused body does not count). A hold waits for the test's file with no deadline of
    its own (a failed test's teardown ends the run)."""

    ROUTES = ("release_memory_occupation", "resume_memory_occupation")

    def __init__(self, environ=None):
        environ = os.environ if environ is None else environ
        self.fail = self._parse(FAIL_ENV, environ.get(FAIL_ENV), 2)
        self.hold = self._parse(HOLD_ENV, environ.get(HOLD_ENV), 3)
        self.calls: collections.Counter = collections.Counter()

    @classmethod
    def _parse(cls, name: str, raw: str | None, parts: int) -> tuple | None:
        if not raw:
            return None
        form = "ROUTE:N" if parts == 2 else "ROUTE:N:DIR"
        fields = raw.split(":", parts - 1)
        if len(fields) != parts or fields[0] not in cls.ROUTES or not fields[1].isdigit() or int(fields[1]) < 1:
            raise ValueError(f"{name}={raw!r}: expected {form} with ROUTE one of {list(cls.ROUTES)} and N >= 1")
        return (fields[0], int(fields[1]), *fields[2:])

    async def before(self, route: str):
        """Count this call of `route`; hold it or answer its injected error (else None: the call proceeds)."""
        self.calls[route] += 1
        n = self.calls[route]
        if self.hold is not None and self.hold[:2] == (route, n):
            where = Path(self.hold[2])
            (where / "held").touch()
            while not (where / "go").exists():
                await asyncio.sleep(0.1)  # the test creates it; the event loop keeps serving meanwhile
        if self.fail == (route, n):
            return _error(f"injected fault: call {n} of /{route} fails ({FAIL_ENV})", 500)
        return None
