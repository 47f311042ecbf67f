"""Trainer side of the weight transfer to the rollout servers (SGLang's update_weights_from_distributed).

One group joins the trainer's source rank (group rank 0) and every engine rank, in the order of `urls`
(server i's ranks start at rank_offset = 1 + sum of the ranks of servers before it). A sync is, on every
server: POST /pause_generation {mode}, POST /begin_weight_update (SGLang 0.5.23 refuses any update outside
this session, answering success=false at once without joining the broadcast), then for each bucket of
(hf_name, tensor) pairs POST /update_weights_from_distributed with the names/dtypes/shapes while rank 0
broadcasts the tensors, then POST /end_weight_update and /continue_generation. Transport: NCCL on GPUs, gloo
on CPU (m2po_megatron.infra.device.dist_backend()).

Only the source rank constructs this class. The group is built from its own TCP store (process_group.py),
so the trainer's default (Megatron) process group is untouched."""
from __future__ import annotations

import concurrent.futures
import json
import time
from typing import Iterable, Sequence

import torch

from m2po_megatron.rollout import _http
from m2po_megatron.infra.net import serve_rendezvous

PAUSE_MODES = ("retract", "in_place", "abort")


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def init_group_body(master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
                    backend: str) -> dict:
    return {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend}


def update_body(bucket: list[tuple[str, torch.Tensor]], group_name: str, weight_version: str | None,
                flush_cache: bool) -> dict:
    """/update_weights_from_distributed body for one bucket (dtype names without the "torch." prefix).
    flush_cache is explicit: SGLang's default (true) fails a bucket whenever a request still runs."""
    return {"names": [n for n, _ in bucket], "dtypes": [_dtype_name(t.dtype) for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket], "group_name": group_name, "flush_cache": flush_cache,
            "abort_all_requests": False, "weight_version": weight_version}


class DistributedWeightSync:
    def __init__(self, urls: Sequence[str], *, master_address: str = "127.0.0.1", master_port: int = 0,
                 ranks_per_server: int | Sequence[int] = 1, backend: str | None = None,
                 group_name: str = "weight_update_group", pause_mode: str = "retract",
                 api_key: str | None = None, timeout_s: float = 600.0):
        """pause_mode (SGLang's /pause_generation modes): "retract" (running requests give back their KV cache
        and are re-prefilled with the new weights after the update; the prefix cache is flushed), "in_place"
        (they keep their KV cache, computed by the old weights, and continue; nothing is flushed, because
        SGLang refuses a flush while requests are running), "abort" (they end now with finish_reason abort).
        A request that continues across an update has its tokens split between versions in its
        weight_versions spans. There is no update without a pause: SGLang 0.5.23 makes such an update wait for
        every running request (every /generate holds its model-update lock), so nothing would interleave.
        ranks_per_server: each server's GPU ranks that join the group, tp_size x dp_size (dp_size is 1:
        SGLang 0.5.23 refuses distributed updates otherwise); rank offsets are numbered server by server."""
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode {pause_mode!r} must be one of {PAUSE_MODES}")
        self.urls = [u.rstrip("/") for u in urls]
        if not self.urls:
            raise ValueError("DistributedWeightSync needs at least one server URL")
        ranks = [ranks_per_server] * len(self.urls) if isinstance(ranks_per_server, int) else list(ranks_per_server)
        if len(ranks) != len(self.urls) or min(ranks) < 1:
            raise ValueError(f"ranks_per_server {ranks_per_server!r} must give a positive count per server")
        self.ranks = ranks
        self.master_address = master_address
        self.master_port = master_port
        if backend is None:
            from m2po_megatron.infra.device import dist_backend

            backend = dist_backend()
        self.backend = backend
        self.group_name = group_name
        self.pause_mode = pause_mode
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.pg = None
        self.broken: str | None = None  # why the group cannot carry another broadcast
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(4, len(self.urls)),
                                                           thread_name_prefix="weight-sync")

    @property
    def world_size(self) -> int:
        return 1 + sum(self.ranks)

    def _post_all(self, path: str, body_for) -> list[concurrent.futures.Future]:
        return [self._pool.submit(_http.post_ok, f"{u}{path}", body_for(i), api_key=self.api_key,
                                  timeout=self.timeout_s) for i, u in enumerate(self.urls)]

    @staticmethod
    def _wait(futs, what: str) -> list[dict]:
        out, errors = [], []
        for f in futs:
            try:
                out.append(f.result())
            except Exception as e:  # noqa: BLE001 - report every server's failure together
                errors.append(repr(e))
        if errors:
            raise RuntimeError(f"{what} failed on {len(errors)} server(s): {errors}")
        return out

    def check_servers(self) -> None:
        """Refuse, before any group forms, servers this sync cannot feed: SGLang 0.5.23 asserts dp_size == 1 in
        update_weights_from_distributed, and each server's engine ranks must be the ranks given here."""
        problems = []
        for url, ranks in zip(self.urls, self.ranks):
            status, text = _http.request(f"{url}/get_server_info", api_key=self.api_key, timeout=60)
            if status != 200:
                problems.append(f"{url}/get_server_info answered {status}: {text[:200]}")
                continue
            info = json.loads(text)
            dp, tp = int(info.get("dp_size") or 1), int(info.get("tp_size") or 1)
            if dp != 1:
                problems.append(f"{url} runs --dp-size {dp}: SGLang updates weights from distributed only with "
                                "dp_size 1; start one server per replica (rollout.num_servers) instead")
            if tp * int(info.get("pp_size") or 1) != ranks:
                problems.append(f"{url} runs tp_size {tp} (pp_size {info.get('pp_size') or 1}) but the weight "
                                f"sync expects {ranks} engine rank(s) for it")
        if problems:
            raise RuntimeError("weight sync refused: " + "; ".join(problems))

    def init_group(self) -> None:
        from m2po_megatron.rollout.process_group import init_custom_process_group

        if self.pg is not None:
            raise RuntimeError("the weight-sync group already exists; call close() first")
        self.check_servers()
        store = None if self.master_port else serve_rendezvous(self.master_address)
        port = self.master_port or store.port
        offsets = [1 + sum(self.ranks[:i]) for i in range(len(self.urls))]
        futs = self._post_all("/init_weights_update_group", lambda i: init_group_body(
            self.master_address, port, offsets[i], self.world_size, self.group_name, self.backend))
        try:
            self.pg = init_custom_process_group(backend=self.backend, master_address=self.master_address,
                                                master_port=port, world_size=self.world_size, rank=0,
                                                group_name=self.group_name, timeout_s=self.timeout_s,
                                                store=store)
        except Exception as e:
            failed = [repr(f.exception()) for f in futs if f.done() and f.exception()]
            raise RuntimeError(f"creating the weight-sync group on {self.master_address}:{port} failed: {e!r}; "
                               f"server answers: {failed}") from e
        self._wait(futs, "/init_weights_update_group")
        self.broken = None

    def _broadcast(self, tensors: list[torch.Tensor], futs, what: str) -> None:
        """Broadcast from rank 0 while the servers' update requests are open. A server that answers before
        its share arrived refused the bucket and will never join: fail now, naming it, instead of waiting
        for the group timeout."""
        import torch.distributed as dist

        works = [dist.broadcast(t, src=0, group=self.pg, async_op=True) for t in tensors]
        deadline = time.monotonic() + self.timeout_s
        while not all(w.is_completed() for w in works):
            refused = [f for f in futs if f.done() and f.exception() is not None]
            if refused or time.monotonic() > deadline:
                self.broken = f"{what} did not complete"
                why = [repr(f.exception()) for f in refused] or [f"no completion within {self.timeout_s:.0f} s"]
                raise RuntimeError(f"{what}: the broadcast cannot complete: {why}")
            time.sleep(0.005)
        for w in works:
            w.wait()
        self._wait(futs, what)

    def _begin_session(self) -> None:
        """POST /begin_weight_update everywhere; if any server refuses, close the sessions that opened."""
        futs = self._post_all("/begin_weight_update", lambda i: {})
        concurrent.futures.wait(futs)
        refused = [(u, f.exception()) for u, f in zip(self.urls, futs) if f.exception() is not None]
        if refused:
            opened = [u for u, f in zip(self.urls, futs) if f.exception() is None]
            for u in opened:
                _http.request(f"{u}/end_weight_update", {}, api_key=self.api_key, timeout=self.timeout_s)
            raise RuntimeError(f"begin_weight_update failed on {len(refused)} server(s): "
                               f"{[f'{u}: {e}' for u, e in refused]}")

    def sync(self, buckets_iter: Iterable[list[tuple[str, torch.Tensor]]], weight_version: int | str) -> dict:
        """Send every bucket inside one weight-update session; the last bucket carries weight_version (so the
        version changes only when all tensors arrived). Returns timing stats (seconds, GB/s)."""
        if self.pg is None:
            raise RuntimeError("call init_group() before sync()")
        if self.broken:
            raise RuntimeError(f"the weight-sync group is unusable ({self.broken}); close() and init_group()")
        it = iter(buckets_iter)
        bucket = next(it, None)
        if bucket is None:
            raise ValueError("the export iterator yielded no bucket; nothing to sync")
        t0 = time.perf_counter()
        device = None
        if self.backend == "nccl":
            from m2po_megatron.infra.device import device as _device

            device = _device()
        nbytes = ntensors = nbuckets = 0
        self._wait(self._post_all("/pause_generation", lambda i: {"mode": self.pause_mode}), "pause_generation")
        try:
            self._begin_session()
            t_transfer = time.perf_counter()
            try:
                while bucket is not None:
                    nxt = next(it, None)
                    last = nxt is None
                    tensors = [t.detach() for _, t in bucket]
                    if device is not None:
                        tensors = [t.to(device, non_blocking=True) for t in tensors]
                    tensors = [t.contiguous() for t in tensors]
                    body = update_body(list(zip([n for n, _ in bucket], tensors)), self.group_name,
                                       str(weight_version) if last else None,
                                       flush_cache=last and self.pause_mode != "in_place")
                    futs = self._post_all("/update_weights_from_distributed", lambda i: body)
                    self._broadcast(tensors, futs, f"update_weights_from_distributed (bucket {nbuckets})")
                    nbytes += sum(t.numel() * t.element_size() for t in tensors)
                    ntensors += len(tensors)
                    nbuckets += 1
                    bucket = nxt
            except BaseException:
                concurrent.futures.wait(self._post_all("/end_weight_update", lambda i: {}))  # the first error wins
                raise
            transfer_s = time.perf_counter() - t_transfer
            self._wait(self._post_all("/end_weight_update", lambda i: {}), "end_weight_update")
        except BaseException:
            concurrent.futures.wait(self._post_all("/continue_generation", lambda i: {}))
            raise
        self._wait(self._post_all("/continue_generation", lambda i: {}), "continue_generation")
        seconds = time.perf_counter() - t0
        return {"seconds": seconds, "transfer_seconds": transfer_s, "bytes": nbytes,
                "gb_per_s": nbytes / 1e9 / max(transfer_s, 1e-9), "num_buckets": nbuckets, "num_tensors": ntensors,
                "weight_version": weight_version, "num_servers": len(self.urls), "backend": self.backend}

    def close(self) -> None:
        from m2po_megatron.rollout.process_group import destroy_custom_process_group

        if self.pg is not None:
            try:
                self._wait(self._post_all("/destroy_weights_update_group",
                                          lambda i: {"group_name": self.group_name}), "destroy_weights_update_group")
            finally:
                destroy_custom_process_group(self.pg)
                self.pg = None
        self._pool.shutdown(wait=False)
