"""The CPU server's weight-update endpoints, as SGLang 0.5.23 answers them: a torch.distributed group over
gloo (init/destroy), the begin/end session every update must run inside, updates from a broadcast or from
serialized tensors, and the weight version. A mixin of LocalServer (local_server.py), which provides
`engine`, `groups`, `session`, `_body`, `_update_lock` and `_flushed`."""
from __future__ import annotations

import asyncio
import os

_NO_SESSION = "{} must run between begin_weight_update() and end_weight_update()"
_NOT_FLUSHED = ("Weights were updated, but the cache was not flushed because requests are still running or "
                "queued. Retract or finish them, then call /flush_cache.")


def _answer(success: bool, message: str, **extra):
    """SGLang's answer to a control call: {success, message}, HTTP 200 or 400."""
    from aiohttp import web

    return web.json_response({"success": success, "message": message, **extra}, status=200 if success else 400)


class WeightEndpoints:
    async def init_group(self, request):
        from aiohttp import web

        from m2po_megatron.rollout.process_group import init_custom_process_group

        body = await self._body(request, "POST /init_weights_update_group")
        backend = body.get("backend", "nccl")
        if backend != "gloo":
            raise ValueError(f"backend {backend!r}: the CPU server joins weight-update groups over gloo only")
        name = body.get("group_name", "weight_update_group")
        if name in self.groups:
            raise ValueError(f"weight update group {name!r} already exists; destroy it first")
        pg = await asyncio.to_thread(init_custom_process_group, backend="gloo",
                                     master_address=body["master_address"], master_port=body["master_port"],
                                     world_size=body["world_size"], rank=body["rank_offset"], group_name=name,
                                     timeout_s=float(os.environ.get("M2PO_WEIGHT_SYNC_TIMEOUT_S", "600")))
        self.groups[name] = pg
        return web.json_response({"success": True, "message": f"Succeeded to initialize group {name}."})

    async def destroy_group(self, request):
        from aiohttp import web

        from m2po_megatron.rollout.process_group import destroy_custom_process_group

        body = await self._body(request, "POST /destroy_weights_update_group")
        name = body.get("group_name", "weight_update_group")
        pg = self.groups.pop(name, None)
        if pg is None:
            raise ValueError(f"no weight update group {name!r}")
        destroy_custom_process_group(pg)
        return web.json_response({"success": True, "message": f"Succeeded to destroy group {name}."})

    async def begin_update(self, request):
        body = await self._body(request, "POST /begin_weight_update")
        async with self._update_lock():
            if self.session is not None:
                return _answer(False, "a weight-update session is already open; call end_weight_update() first")
            self.session = body.get("selector", "all")
        return _answer(True, "Success")

    async def end_update(self, request):
        await self._body(request, "POST /end_weight_update")
        async with self._update_lock():
            if self.session is None:
                return _answer(False, "no weight-update session is open; call begin_weight_update() first")
            self.session = None
        return _answer(True, "Success")

    def _load(self, body: dict, named) -> tuple[bool, str]:
        """Load received tensors (a "draft" selector loads nothing: this server has no draft model, as an
        SGLang server without speculative decoding), record the version, then flush as asked."""
        if body.get("selector", "all") != "draft":
            self.engine.load_weights(named, None)
        if body.get("weight_version") is not None:
            self.engine.load_weights([], body["weight_version"])
        if body.get("flush_cache", True) and not self._flushed():
            return False, _NOT_FLUSHED
        message = "Succeeded to update parameter online."
        if body.get("weight_version") is not None:
            message += f" Weight version updated to {body['weight_version']}."
        return True, message

    async def update_distributed(self, request):
        body = await self._body(request, "POST /update_weights_from_distributed")
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        if body.get("abort_all_requests"):
            self.engine.abort(None, "Abort by weight update")
        async with self._update_lock():
            if self.session is None:  # SGLang answers at once and never joins the broadcast
                return _answer(False, _NO_SESSION.format("update_weights_from_distributed"))
            pg = self.groups.get(body.get("group_name", "weight_update_group"))
            if pg is None or not len(names) == len(dtypes) == len(shapes) \
                    or body.get("load_format") not in (None, "auto"):
                why = ("no such weight update group: call /init_weights_update_group first" if pg is None else
                       f"load_format {body['load_format']!r} is not supported by the CPU server"
                       if body.get("load_format") not in (None, "auto") else
                       "names, dtypes and shapes must have the same length")
                return _answer(False, f"Failed to receive weights: {why}")
            try:
                tensors = await asyncio.to_thread(_receive, pg, dtypes, shapes)
            except Exception as e:  # noqa: BLE001 - reported like SGLang's receive failure
                return _answer(False, f"Failed to receive weights: {e}")
            try:
                ok, message = self._load(body, list(zip(names, tensors)))
            except (KeyError, ValueError) as e:  # after the receive, so the trainer's broadcast completed
                return _answer(False, f"Failed to update weights: {e}")
        return _answer(ok, message)

    async def update_tensor(self, request):
        """SGLang 0.5.23's body: one payload per engine TP rank (this server is one rank: it reads entry 0, as
        SGLang's rank 0 does), each MultiprocessingSerializer's base64 form of [(hf_name, tensor)], read by a
        restricted unpickler (server_memory.py); CPU tensors only (shared memory by name)."""
        from m2po_megatron.rollout.server_memory import load_named_tensors

        body = await self._body(request, "POST /update_weights_from_tensor")
        if body.get("load_format") is not None:  # SGLang's "direct"/"flattened_bucket"/custom loaders
            raise ValueError(f"load_format {body['load_format']!r} is not supported by the CPU server; send null")
        if body.get("abort_all_requests"):
            self.engine.abort(None, "Abort by weight update")
        async with self._update_lock():
            if self.session is None:
                return _answer(False, _NO_SESSION.format("update_weights_from_tensor"))
            payloads = body["serialized_named_tensors"]
            if not payloads:
                return _answer(False, "Failed to update weights: serialized_named_tensors is empty; send one "
                                      "payload per TP rank")
            try:
                named = await asyncio.to_thread(load_named_tensors, payloads[0])
                ok, message = self._load(body, named)
            except (KeyError, ValueError) as e:
                return _answer(False, f"Failed to update weights: {e}")
        return _answer(ok, message)

    async def update_weight_version(self, request):
        from aiohttp import web

        body = await self._body(request, "POST /update_weight_version")
        if body.get("abort_all_requests", True):
            self.engine.abort(None, "Abort by weight version update")
        self.engine.load_weights([], body["new_version"])
        return web.json_response({"success": True, "message": f"Weight version updated to {body['new_version']}",
                                  "new_version": body["new_version"]})


def _receive(pg, dtypes, shapes):
    import torch
    import torch.distributed as dist

    out = [torch.empty(shape, dtype=getattr(torch, str(dt).removeprefix("torch."))) for dt, shape in zip(dtypes, shapes)]
    for work in [dist.broadcast(t, src=0, group=pg, async_op=True) for t in out]:  # queued in order, as sent
        work.wait()
    return out
