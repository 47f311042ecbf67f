"""Client side of colocation (issue 49): the calls that make an SGLang 0.5.23 engine give back its GPU memory
while the trainer uses the same GPU, take it back, and receive the trainer's new weights from that GPU.

    release_memory(url, key, TAGS_ALL, t)       POST /release_memory_occupation {"tags": [...]}
    resume_memory(url, key, WEIGHTS, t)         POST /resume_memory_occupation  {"tags": [...]}
    update_weights_from_tensor(url, key, [serialize_named_tensors(pairs)], version, t)
        POST /begin_weight_update, POST /update_weights_from_tensor, POST /end_weight_update
    resume_memory(url, key, KV, t)

Tags are SGLang's (srt/constants.py). SGLang refuses a release unless the engine is idle, and resumed weights
hold garbage until updated (without --enable-weights-cpu-backup), so the update must follow the weights'
resume before generating again.

The wire form of the tensors is SGLang's MultiprocessingSerializer.serialize(pairs, output_str=True): torch's
ForkingPickler of the list of (hf_name, tensor) pairs, base64. A pickle of a tensor carries a handle to its
memory, not the data:
- CUDA tensors travel as CUDA IPC handles: the engine maps the trainer's GPU memory, so both must be on the
  same GPU (colocated), and the device is named by its UUID, as SGLang's patched torch reductions write it on
  the sending side and read it on the receiving one, because the two processes may number their visible GPUs
  differently.
- CPU tensors travel as shared memory named by file (torch's "file_system" sharing strategy, set for the
  duration of the pickling): the default "file_descriptor" strategy passes descriptors over a socket of the
  sending process that only its own children may join, so an unrelated server receiving bytes over HTTP could
  not open them. Pickling moves each tensor's storage into shared memory.
Either way the sender must keep the tensors alive until the request that carries them has returned."""
from __future__ import annotations

import base64
import contextlib
import io
from multiprocessing.reduction import ForkingPickler
from typing import Sequence

import torch
from torch.multiprocessing import reductions

from m2po_megatron.rollout import _http

TAGS_ALL = ("kv_cache", "weights", "cuda_graph")
WEIGHTS = ("weights",)
KV = ("kv_cache", "cuda_graph")

_CUDA_DEVICE_ARG = 6  # position of the device index in torch's reduce_tensor arguments for a CUDA tensor


def _checked(endpoint: str, body: dict) -> dict:
    from m2po_megatron.rollout.protocol import validate_request

    validate_request(endpoint, body)  # a field SGLang does not know is our typo: refused before sending
    return body


def _post(url: str, path: str, body: dict, api_key: str | None, timeout_s: float) -> dict:
    """post_ok with connection failures also reported as RuntimeError naming the server."""
    try:
        return _http.post_ok(f"{url.rstrip('/')}{path}", body, api_key=api_key, timeout=timeout_s)
    except OSError as e:
        raise RuntimeError(f"{url.rstrip('/')}{path}: no answer: {e}") from e


def release_memory(url: str, api_key: str | None, tags: Sequence[str], timeout_s: float) -> None:
    """Make the engine give back the memory of `tags` (the engine must be idle)."""
    body = _checked("POST /release_memory_occupation", {"tags": list(tags)})
    _post(url, "/release_memory_occupation", body, api_key, timeout_s)


def resume_memory(url: str, api_key: str | None, tags: Sequence[str], timeout_s: float) -> None:
    """Make the engine allocate again the memory of `tags` (released before)."""
    body = _checked("POST /resume_memory_occupation", {"tags": list(tags)})
    _post(url, "/resume_memory_occupation", body, api_key, timeout_s)


class _Pickler(ForkingPickler):
    """ForkingPickler whose CUDA tensors name their device by UUID (see the module docstring); everything else
    is pickled exactly as ForkingPickler does."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.is_cuda:
            rebuild, args = reductions.reduce_tensor(obj)
            uuid = str(torch.cuda.get_device_properties(args[_CUDA_DEVICE_ARG]).uuid)
            return rebuild, (*args[:_CUDA_DEVICE_ARG], uuid, *args[_CUDA_DEVICE_ARG + 1:])
        return NotImplemented


@contextlib.contextmanager
def _file_system_sharing():
    import torch.multiprocessing as mp

    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        mp.set_sharing_strategy(before)


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """[(hf_name, tensor)] -> SGLang's wire form (one entry of serialized_named_tensors). Keep the tensors
    alive until the update request returns. CPU tensors are moved into shared memory: pass the exported copies
    (HF buckets), not live parameters."""
    pairs = []
    for i, item in enumerate(named):
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise TypeError(f"named[{i}] must be a (str, torch.Tensor) pair, got {type(item).__name__}")
        pairs.append((item[0], item[1].detach()))
    buf = io.BytesIO()
    with _file_system_sharing():
        _Pickler(buf).dump(pairs)
    return base64.b64encode(buf.getvalue()).decode("utf-8")


def update_weights_from_tensor(url: str, api_key: str | None, per_rank: list[str], weight_version: str,
                               timeout_s: float) -> None:
    """Load new weights into the engine at `url` inside one weight-update session (SGLang 0.5.23 refuses an
    update outside /begin_weight_update ... /end_weight_update). per_rank: serialize_named_tensors' output for
    each of the engine's TP ranks, in rank order. The engine's cache is flushed and its weight version set.
    Raises RuntimeError naming the server and SGLang's message; the session is closed either way."""
    if not per_rank or not all(isinstance(p, str) for p in per_rank):
        raise ValueError("per_rank must hold one serialize_named_tensors() string per engine TP rank")
    body = _checked("POST /update_weights_from_tensor",
                    {"serialized_named_tensors": list(per_rank), "flush_cache": True, "abort_all_requests": False,
                     "weight_version": str(weight_version)})
    _post(url, "/begin_weight_update", _checked("POST /begin_weight_update", {}), api_key, timeout_s)
    try:
        _post(url, "/update_weights_from_tensor", body, api_key, timeout_s)
    except BaseException:
        with contextlib.suppress(Exception):  # the update's error is the one to report
            _post(url, "/end_weight_update", {}, api_key, timeout_s)
        raise
    _post(url, "/end_weight_update", _checked("POST /end_weight_update", {}), api_key, timeout_s)
