"""A tiny rollout server launched as the recipes launch it (rollout/launcher.EngineManager: a Ray actor pinned
to a rollout node, bound to that node's address, an API key), then the weight-update round trip the run makes and
a generation whose tokens must show the new weights (tiny_model.marked_weights: greedy decoding then repeats a
chosen token). The weights go as the recipe's layout sends them: update_weights_from_distributed from a trainer
-side Ray actor (NCCL on GPUs, gloo on CPU), or update_weights_from_tensor where the engine shares the sender's
GPU (cluster.colocate, or one GPU in all). CPU server on CPU, SGLang on GPUs (rollout.engine)."""
from __future__ import annotations

import importlib.util
import json
import secrets
import urllib.error
import urllib.request
from pathlib import Path

from m2po_megatron.infra.cluster import ROLLOUT_RESOURCE, TRAINER_RESOURCE
from m2po_megatron.preflight.checks import CheckFailed, CheckSkipped, cluster_has_gpus, connect_ray

PROMPT = [1, 2, 3, 4, 5]
NEW_TOKENS = 8
VERSION = "preflight-1"


def generate(url: str, api_key: str | None, timeout_s: float) -> dict:
    """Greedy /generate of PROMPT (SGLang's body and answer)."""
    body = {"input_ids": PROMPT, "sampling_params": {"temperature": 0.0, "max_new_tokens": NEW_TOKENS,
                                                     "ignore_eos": True}}
    req = urllib.request.Request(f"{url}/generate", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {api_key}"} if api_key else {})})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


class WeightSender:
    """The trainer's side of the update, as a Ray actor on a trainer node (its GPU where the run has one)."""

    def push(self, urls: list[str], api_key: str | None, model_dir: str, token: int, transport: str,
             timeout_s: float) -> dict:
        import torch

        from m2po_megatron.infra.cluster import node_ip
        from m2po_megatron.infra.device import dist_backend
        from m2po_megatron.preflight.tiny_model import marked_weights

        bucket = marked_weights(Path(model_dir), token)
        if torch.cuda.is_available():
            bucket = [(n, t.cuda()) for n, t in bucket]
        if transport == "tensor":
            from m2po_megatron.rollout.tensor_sync import TensorWeightSync

            nbytes = TensorWeightSync(urls[0], api_key, timeout_s=timeout_s).send(bucket, VERSION)
            return {"transport": "update_weights_from_tensor", "bytes": nbytes}
        from m2po_megatron.rollout.weight_sync import DistributedWeightSync

        sync = DistributedWeightSync(urls, master_address=node_ip(), backend=dist_backend(), api_key=api_key,
                                     timeout_s=timeout_s)
        try:
            sync.init_group()
            stats = sync.sync(iter([bucket]), VERSION)
        finally:
            sync.close()
        return {"transport": "update_weights_from_distributed", "backend": stats["backend"],
                "bytes": stats["bytes"], "sync_s": round(stats["seconds"], 3)}


def _engine(cfg, gpu: bool) -> str:
    engine = cfg.rollout.engine
    if engine == "sglang" and not gpu:
        raise CheckSkipped("rollout.engine is sglang and this machine has no GPU (the CPU server's path runs with "
                           "rollout.engine=local)")
    if engine == "sglang" and importlib.util.find_spec("sglang") is None:
        raise CheckFailed("rollout.engine is sglang but sglang is not importable here",
                          "run in the project's image (docs/container.md: M2PO_CONTAINER) or install the locked "
                          "sglang (requirements/)")
    return engine


def _start_failure(e: Exception, spec) -> CheckFailed:
    text = str(e)
    if "not free" in text or "address already in use" in text.lower():
        return CheckFailed(f"the server's port is taken: {text.splitlines()[0][:300]}",
                           f"free port {spec.port} on the rollout node, or use rollout.port=0 (a free port each start)")
    if "no config.json" in text:
        return CheckFailed(f"the server's model is missing: {text.splitlines()[0][:300]}",
                           "the preflight's work directory (under run.output_dir) must be on storage every node "
                           "sees")
    return CheckFailed(f"the rollout server did not start: {text.splitlines()[0][:400]}",
                       "read the server's log named in `detail` (RUN_DIR/preflight/rollout/server_0.log)")


def run(cfg, ctx: dict) -> dict:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from m2po_megatron.preflight import tiny_model
    from m2po_megatron.rollout.launcher import EngineManager, ServerSpec
    from m2po_megatron.rollout.server_spec import ServerStartError

    ray = connect_ray(ctx)
    gpu = ctx["gpu"] or cluster_has_gpus(ray)
    engine = _engine(cfg, gpu)
    work = Path(ctx["work_dir"])
    model_dir = tiny_model.build(work / "tiny-model", "bfloat16" if engine == "sglang" else "float32")
    gpus_in_cluster = sum(n["Resources"].get("GPU", 0) for n in ray.nodes() if n.get("Alive"))
    shared = bool(cfg.cluster.colocate) or (gpu and gpus_in_cluster < 2)
    transport = "tensor" if shared else "distributed"
    key = ctx.get("api_key")
    r = cfg.rollout
    spec = ServerSpec(model_path=str(model_dir), engine=engine, host=r.host or "auto", port=r.port or 0,
                      api_key=key, random_seed=0, weight_version="0", served_model_name="m2po-preflight-"
                      + secrets.token_hex(4), context_length=512, mem_fraction_static=0.3 if engine == "sglang"
                      else None, dtype="bfloat16" if engine == "sglang" else "auto")
    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["Resources"].get(ROLLOUT_RESOURCE)]
    if not nodes:
        raise CheckFailed(f"no Ray node offers the '{ROLLOUT_RESOURCE}' resource",
                          "tag the rollout nodes (slurm/ray_node.sh does; the `ray` check says which are up)")
    limit = ctx["limit_s"]
    mgr = EngineManager([spec], run_dir=str(work), use_ray=True, max_restarts=0, health_timeout_s=limit * 0.6,
                        node_ids=[nodes[0]], num_cpus_per_server=0,
                        num_gpus_per_server=(0.5 if shared else 1) if engine == "sglang" else 0)
    numbers: dict = {"engine": engine, "transport": transport}
    sender = None
    try:
        try:
            [url] = mgr.start()
        except (ServerStartError, ValueError) as e:
            raise _start_failure(e, spec) from None
        numbers["server_host"] = url.split("//", 1)[1].rsplit(":", 1)[0]  # the node's address, never 0.0.0.0
        numbers["server_log"] = mgr.log_path(0)
        before = generate(url, key, limit / 6)
        first = before["output_ids"]
        token = (first[0] + 1) % tiny_model.CONFIG["vocab_size"]
        opts = dict(num_cpus=0, num_gpus=(0.5 if shared else 1) if gpu else 0, resources={TRAINER_RESOURCE: 1e-3})
        if shared:  # the engine's GPU is the sender's: the same node
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(nodes[0], soft=False)
        sender = ray.remote(WeightSender).options(**opts).remote()
        try:
            numbers.update(ray.get(sender.push.remote([url], key, str(model_dir), token, transport, limit / 4),
                                   timeout=limit / 3))
        except ray.exceptions.GetTimeoutError:
            raise CheckFailed(f"the weight update ({transport}) did not finish within {limit / 3:.0f} s",
                              "the servers could not join the trainer's group: GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME "
                              "must name an interface both nodes reach (docs/cluster.md)", numbers) from None
        except ray.exceptions.RayTaskError as e:
            raise CheckFailed(f"the weight update ({transport}) failed: {str(e.cause or e)[:500]}",
                              "read the server's log (numbers.server_log) for its side of the update", numbers) from None
        after = generate(url, key, limit / 6)
    except (urllib.error.URLError, OSError) as e:
        raise CheckFailed(f"the server stopped answering: {e}", "read the server's log (numbers.server_log)",
                          numbers) from None
    finally:
        if sender is not None:
            ray.kill(sender)
        mgr.shutdown()
    got, version = after["output_ids"], after["meta_info"].get("weight_version")
    numbers.update(tokens_before=first, tokens_after=got, weight_version=version)
    if got != [token] * NEW_TOKENS or version != VERSION:
        raise CheckFailed(f"after the update the server generated {got} at weight_version {version!r}; the new "
                          f"weights make it repeat token {token} at version {VERSION!r}",
                          "the engine did not load the update: read the server's log (numbers.server_log) and check "
                          "that its SGLang version is the locked one", numbers)
    return numbers
