"""`m2po train`: the RL loop, top to bottom.

Ray placement -> data -> generation -> rewards -> advantages -> staleness gating -> training -> weight
sync -> evaluation -> logging -> checkpoints. Each algorithmic hook is a named function below or in the
module that owns it (samples.build_step_batch, generation.*, staleness.*, algo.*)."""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

from omegaconf import DictConfig

from m2po_megatron import device
from m2po_megatron.config import as_plain, run_dir, save_resolved, secret
from m2po_megatron.metrics import MetricsLogger, Progress


def train(cfg: DictConfig) -> Path:
    from m2po_megatron.cluster import init_ray, shutdown_ray
    from m2po_megatron.run_state import CheckpointManager, install_sigterm_flag
    from m2po_megatron.staleness import SampleLedger

    rdir = run_dir(cfg)
    ckpts = CheckpointManager(rdir / "checkpoints", keep_last=cfg.checkpoint.keep_last)
    resume_from = ckpts.resolve_resume(cfg.run.resume)
    save_resolved(cfg, rdir)
    logger = MetricsLogger(rdir, config=as_plain(cfg), wandb_mode=cfg.logging.wandb_mode,
                           project=cfg.logging.wandb_project, entity=cfg.logging.wandb_entity,
                           name=cfg.run.name, resume=resume_from is not None)
    stop = install_sigterm_flag()
    seed_everything(cfg.run.seed)
    world = trainer_world_size(cfg)
    init_ray(cfg.cluster.ray_address, tmpdir=cfg.cluster.ray_tmpdir,
             object_store_memory_mb=cfg.cluster.object_store_memory_mb, trainer_slots=world,
             rollout_slots=cfg.rollout.num_servers)
    engines = trainers = generator = rewards = client = None
    try:
        tokenizer = load_tokenizer(cfg)
        prompts, eval_rows = load_data(cfg, tokenizer)
        engines, urls = start_rollout_engines(cfg, rdir)
        client = make_client(cfg, urls)
        trainers = start_trainers(cfg, world, rdir)
        init_weight_sync(cfg, trainers, urls)
        rewards = make_reward_pool(cfg)
        ledger = SampleLedger()
        generator = make_generator(cfg, client, rewards, tokenizer, prompts, ledger, trainers)
        step, version = 0, 0
        if resume_from is not None:
            step, version = restore(resume_from, trainers, prompts, ledger, generator)
            push_weights(trainers, generator, version)  # new servers hold the base weights
        if step == 0 and eval_rows:  # the starting point, before generation competes for the servers
            logger.log(evaluate(cfg, client, tokenizer, eval_rows, rdir, step, generator), step=0)
        start_generation(generator)

        restarts = server_restarts(engines)
        U = cfg.train.updates_per_step
        progress = Progress(cfg.train.steps - step, "train", unit="step")
        synced = version  # the version the servers hold
        while step < cfg.train.steps and not stop.requested:
            t0 = time.perf_counter()
            groups = generator.next_groups(version)  # blocks until a batch may be trained
            t_wait = time.perf_counter() - t0

            with generator.lock:  # the generation thread writes the ledger too
                sb = build_batch(cfg, groups, version, ledger)  # advantages, staleness gating, ledger
            t1 = time.perf_counter()
            out = train_on(cfg, trainers, sb.batch, ckpts)
            out.update(logprob_mismatch(sb.samples, out.pop("per_update", None), version))
            t_train = time.perf_counter() - t1
            applied = U if sb.batch is not None else 0  # a step whose samples were all dropped updates nothing
            version += applied
            step += 1
            if hasattr(generator, "ctl"):
                generator.ctl.on_step(version, updates=applied)

            t2 = time.perf_counter()
            sync_stats = resync_restarted_servers(cfg, engines, trainers, urls, generator, version, restarts)
            synced = version if sync_stats else synced
            eval_now = bool(eval_rows) and cfg.eval.interval > 0 and step % cfg.eval.interval == 0
            if should_sync(cfg, generator) or (eval_now and synced != version):
                sync_stats.update(sync_or_recover(cfg, engines, trainers, urls, generator, version, restarts))
                synced = version
            t_sync = time.perf_counter() - t2

            with generator.lock:
                accounting = ledger.end_step(pending=generator.pending())  # generated = consumed + dropped + pending
            metrics = {"version": version, **sb.metrics, **out, **accounting,
                       **rewards_stats(generator), **sync_stats,
                       "time/wait_rollout": t_wait, "time/train": t_train, "time/weight_sync": t_sync,
                       "time/step": time.perf_counter() - t0,
                       "tokens_per_s/train": sb.metrics.get("batch/tokens", 0) / max(t_train, 1e-9),
                       "tokens_per_s/gen": gen_throughput(generator, t0)}
            if eval_now:
                metrics.update(evaluate(cfg, client, tokenizer, eval_rows, rdir, step, generator))
            logger.log(metrics, step=step)
            progress.update(postfix=f"reward {metrics.get('reward/mean', float('nan')):.3f} "
                                    f"staleness {metrics.get('staleness/mean', 0):.1f}")
            if cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0:
                save_checkpoint(ckpts, step, version, trainers, prompts, ledger, generator)

        progress.close()
        if stop.requested:
            print(f"[m2po] {stop.signal_name} received: checkpointing at step {step} and exiting", flush=True)
        if not (cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0) or stop.requested:
            if cfg.checkpoint.save_on_sigterm or not stop.requested:
                save_checkpoint(ckpts, step, version, trainers, prompts, ledger, generator)
        if not stop.requested and eval_rows and not (cfg.eval.interval and step % cfg.eval.interval == 0):
            if synced != version:
                push_weights(trainers, generator, version)
            logger.log(evaluate(cfg, client, tokenizer, eval_rows, rdir, step, generator), step=step)
    finally:
        for closer in (generator, rewards, client):
            if closer is not None:
                closer.close()
        if trainers is not None:
            trainers.kill()
        if engines is not None:
            engines.shutdown()
        logger.close()
        shutdown_ray()
    return rdir


# ----------------------------------------------------------------------------------------------------
# Set-up hooks
# ----------------------------------------------------------------------------------------------------
def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def trainer_world_size(cfg: DictConfig) -> int:
    p = cfg.parallel
    return (p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
            * p.data_parallel_size)


def load_tokenizer(cfg: DictConfig):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg.model.tokenizer or cfg.model.hf_path)


def load_data(cfg: DictConfig, tokenizer):
    """Training prompts and eval sets, each prompt the exact text the model sees (data.prompt_template and
    the chat template applied the same way to both; see data.prepare.final_prompts)."""
    from m2po_megatron.data.prepare import final_prompts
    from m2po_megatron.generation import PromptStream, load_prompt_rows

    if not cfg.data.train_path:
        raise ValueError("data.train_path is not set; prepare data with `m2po prepare-data`")
    from m2po_megatron.eval.benchmarks import EvalSet

    d = cfg.data

    def rows(path: str) -> list[dict]:
        return final_prompts(load_prompt_rows(path), template=d.prompt_template, tokenizer=tokenizer,
                             apply_chat_template=d.apply_chat_template, source=path)

    prompts = PromptStream(rows(d.train_path), d.shuffle_seed)
    e = cfg.eval
    eval_sets = []
    for path in d.eval_paths:
        name = Path(path).name.split(".")[0]
        eval_sets.append(EvalSet(name, rows(path), e.n_samples_overrides.get(name, e.n_samples)))
    return prompts, eval_sets


def start_rollout_engines(cfg: DictConfig, rdir: Path):
    """Launch the servers as Ray actors on the `rollout` nodes (SGLang on GPUs, our CPU server otherwise),
    or attach to rollout.urls. Returns (manager or None, urls)."""
    import ray

    from m2po_megatron.cluster import ROLLOUT_RESOURCE
    from m2po_megatron.rollout.launcher import EngineManager, ServerSpec

    r = cfg.rollout
    api_key = secret(r.api_key, "M2PO_API_KEY")
    if r.urls:
        return None, EngineManager.attach(list(r.urls), api_key=api_key, timeout_s=r.health_timeout_s)
    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["Resources"].get(ROLLOUT_RESOURCE)]
    if not nodes:
        raise RuntimeError(f"no Ray node offers the '{ROLLOUT_RESOURCE}' resource for rollout servers; start "
                           f"rollout nodes with --resources='{{\"{ROLLOUT_RESOURCE}\": N}}' (slurm/ does)")
    specs = [ServerSpec(model_path=str(Path(cfg.model.hf_path).resolve()), engine=r.engine, host=r.host or "auto",
                        port=r.port + i if r.host else 0, tp_size=r.tp_size, dp_size=r.dp_size,
                        mem_fraction_static=r.mem_fraction_static, context_length=r.context_length,
                        dtype=r.dtype, quantization=r.quantization, api_key=api_key,
                        random_seed=cfg.run.seed + i, weight_version="0")
             for i in range(r.num_servers)]
    pinned = [nodes[i % len(nodes)] for i in range(r.num_servers)]
    mgr = EngineManager(specs, run_dir=str(rdir), use_ray=True, max_restarts=r.max_restarts,
                        health_timeout_s=r.health_timeout_s, node_ids=pinned,
                        num_cpus_per_server=0, env={"OMP_NUM_THREADS": "1"})
    urls = mgr.start()
    by_id = {n["NodeID"]: n for n in ray.nodes()}
    placed = [{"server": i, "node": by_id[nid]["NodeManagerHostname"], "ip": by_id[nid]["NodeManagerAddress"],
               "url": url} for i, (nid, url) in enumerate(zip(pinned, urls))]
    record_placement(rdir, "rollout", placed)
    return mgr, urls


def record_placement(rdir: Path, role: str, entries: list[dict]) -> None:
    """One `[placement]` line per rank/server (the Slurm tests read them) and RUN_DIR/placement.json."""
    for e in entries:
        print(f"[placement] role={role} " + " ".join(f"{k}={v}" for k, v in e.items()), flush=True)
    path = rdir / "placement.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[role] = entries
    path.write_text(json.dumps(data, indent=1))


def make_client(cfg: DictConfig, urls: list[str]):
    from m2po_megatron.rollout.client import SyncRolloutClient

    r = cfg.rollout
    return SyncRolloutClient(urls, api_key=secret(r.api_key, "M2PO_API_KEY"),
                             max_concurrency_per_server=r.max_concurrency, request_timeout_s=r.request_timeout_s,
                             max_retries=r.max_retries)


def actor_kwargs(cfg: DictConfig) -> dict:
    p, o, a = cfg.parallel, cfg.optim, cfg.algo
    dtype = cfg.model.params_dtype
    if dtype == "auto":
        dtype = "bf16" if device.has_cuda() else "fp32"
    loss_kwargs = {"loss_agg_mode": a.gspo.loss_agg_mode if a.name == "gspo" else a.loss_agg_mode}
    if a.dual_clip_c is not None:
        loss_kwargs["dual_clip"] = a.dual_clip_c
    if a.name == "grpo":
        loss_kwargs.update(eps_low=a.grpo.eps_clip_low, eps_high=a.grpo.eps_clip_high)
    elif a.name == "gspo":
        loss_kwargs.update(eps_low=a.gspo.eps_clip_low, eps_high=a.gspo.eps_clip_high)
    total_updates = cfg.train.steps * cfg.train.updates_per_step
    return dict(
        hf_model_dir=cfg.model.hf_path, hf_config=cfg.model.hf_config, load_from=cfg.model.megatron_ckpt,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
        context_parallel_size=p.context_parallel_size, sequence_parallel=p.sequence_parallel,
        recompute_granularity=p.recompute_granularity, recompute_method=p.recompute_method,
        recompute_num_layers=p.recompute_num_layers,
        use_distributed_optimizer=p.use_distributed_optimizer, precision=dtype, fp8=cfg.model.fp8,
        fp8_recipe=cfg.model.fp8_recipe if cfg.model.fp8 else None, lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=o.warmup_updates,
        lr_decay_steps=max(total_updates, 1), lr_decay_style=o.lr_schedule, weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad,
        micro_batch_tokens=cfg.train.micro_batch_tokens, loss_name=a.name, loss_kwargs=loss_kwargs,
        m2po_tau=a.m2po.tau, m2po_rule=a.m2po.rule,
        m2po_scope="minibatch" if a.m2po.scope == "global" else "microbatch", seed=cfg.run.seed)


def start_trainers(cfg: DictConfig, world: int, rdir: Path):
    """One Ray actor per Megatron rank on the `trainer` nodes."""
    from m2po_megatron.cluster import RankGroup
    from m2po_megatron.trainer_worker import TrainerWorker

    gpus = 1 if cfg.cluster.gpus_per_node else 0
    group = RankGroup(TrainerWorker, world, gpus_per_rank=gpus,
                      env={"OMP_NUM_THREADS": 1, "M2PO_TRAINER_THREADS": 1})
    nodes = group.call("setup", actor_kwargs(cfg), timeout=1800)
    record_placement(rdir, "trainer", [{"rank": n["rank"], "node": n["hostname"], "ip": n["ip"], "pid": n["pid"]}
                                       for n in nodes])
    return group


def init_weight_sync(cfg: DictConfig, trainers, urls: list[str], generation: int = 0) -> None:
    r = cfg.rollout
    ranks = r.tp_size if r.engine == "sglang" else 1  # engine ranks per server join the group
    trainers.call("init_weight_sync", urls, secret(r.api_key, "M2PO_API_KEY"), r.bucket_mb, 0, r.update_mode,
                  ranks, f"weight_update_group_{generation}", timeout=600)


def server_restarts(engines) -> list[int]:
    return [] if engines is None else [i["restarts"] for i in engines.info()]


def wait_servers(cfg: DictConfig, engines, urls: list[str]) -> None:
    """Block until every server answers /health_generate; a server whose restart budget is spent ends
    the run with its URL and log."""
    from m2po_megatron.rollout.launcher import wait_healthy

    for info in engines.info():
        if info.get("last_error"):
            raise RuntimeError(f"rollout server {info['url']} is down and was not restarted: "
                               f"{info['last_error']} (rollout.max_restarts = {cfg.rollout.max_restarts}); "
                               f"log: {info['log']}")
    for url in urls:
        wait_healthy(url, api_key=secret(cfg.rollout.api_key, "M2PO_API_KEY"), timeout_s=cfg.rollout.health_timeout_s)


def resync_restarted_servers(cfg, engines, trainers, urls, generator, version, seen: list[int]) -> dict:
    """A restarted server lost the weight-sync group and holds the base weights: once every server is
    healthy, form a new group with all of them and push the current weights. Its requests in flight were
    re-issued by the client; groups it answered with old weights are dropped (counted) by the generator."""
    now = server_restarts(engines)
    if now == seen:
        return {}
    wait_servers(cfg, engines, urls)
    init_weight_sync(cfg, trainers, urls, generation=sum(now))
    stats = push_weights(trainers, generator, version)
    seen[:] = server_restarts(engines)
    print(f"[m2po] rollout server restart detected (restarts {seen}); weights re-synced at version {version}",
          flush=True)
    return {"rollout/server_restarts": sum(seen), **stats}


def sync_or_recover(cfg, engines, trainers, urls, generator, version, seen: list[int]) -> dict:
    """Push weights; if a server died during the push, wait for its restart and re-sync everyone."""
    import ray

    try:
        return push_weights(trainers, generator, version)
    except ray.exceptions.RayTaskError:
        if engines is None:
            raise
        deadline = time.monotonic() + cfg.rollout.health_timeout_s
        while server_restarts(engines) == seen and time.monotonic() < deadline:
            time.sleep(1.0)  # the watchdog notices the death within a second
        if server_restarts(engines) == seen:
            raise
        return resync_restarted_servers(cfg, engines, trainers, urls, generator, version, seen)


def make_reward_pool(cfg: DictConfig):
    from m2po_megatron.reward import RewardPool

    return RewardPool(num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s,
                      format_score=cfg.reward.format_score)


def make_generator(cfg, client, rewards, tokenizer, prompts, ledger, trainers):
    from m2po_megatron.generation import AsyncGenerator, GroupMaker, SyncGenerator, Tokenize
    from m2po_megatron.staleness import FixedLagQueue, StalenessController

    r, s, t = cfg.rollout, cfg.staleness, cfg.train
    sampling = {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k,
                "max_new_tokens": r.max_new_tokens}
    maker = GroupMaker(client, rewards, tokenizer, Tokenize(tokenizer, cfg.data.max_prompt_len),
                       sampling, n=r.n_samples_per_prompt, seed=cfg.run.seed)
    if s.mode == "bounded":
        ctl = StalenessController(s.max_staleness, groups_per_step=t.prompts_per_step,
                                  updates_per_step=t.updates_per_step, sync_interval=s.sync_interval)
        return AsyncGenerator(maker, prompts, ledger, ctl, t.prompts_per_step)
    queue = FixedLagQueue(s.lag_steps, t.updates_per_step) if s.mode == "fixed_lag" else None
    recompute = None
    if s.behav_logprob_source == "trainer":
        recompute = lambda groups: recompute_behaviour_logprobs(trainers, groups)  # noqa: E731
    return SyncGenerator(maker, prompts, ledger, t.prompts_per_step, queue, recompute)


def start_generation(generator) -> None:
    if hasattr(generator, "start"):
        generator.start()


# ----------------------------------------------------------------------------------------------------
# Per-step hooks
# ----------------------------------------------------------------------------------------------------
def build_batch(cfg: DictConfig, groups, version: int, ledger):
    from m2po_megatron.samples import build_step_batch

    s = cfg.staleness
    bound = s.max_staleness if s.mode == "bounded" else None
    return build_step_batch(groups, version, ledger, max_staleness=bound, drop_too_stale=s.drop_too_stale,
                            norm_by_std=cfg.algo.norm_adv_by_std, eps=cfg.algo.adv_eps)


def train_on(cfg: DictConfig, trainers, batch, ckpts) -> dict:
    import ray

    if batch is None:  # every sample of the step was dropped (counted); nothing to train on
        return {}
    ref = ray.put(batch)
    try:
        out = trainers.call("train_step", ref, cfg.train.updates_per_step)[0]
    except ray.exceptions.RayActorError as e:
        latest = ckpts.latest()
        raise RuntimeError(f"a trainer rank died during the train step ({e.__class__.__name__}); the run stops. "
                           + (f"Resume from {latest} with `--resume auto`." if latest else
                              "No checkpoint was written yet; start again.")) from e
    return out


def logprob_mismatch(samples, per_update, version: int) -> dict:
    """Behaviour (engine) vs trainer log-probs at the same weights: the first update of a step whose
    samples were all generated at the step's starting version sees exactly that pair (ratio = 1 up to
    numerics; FP8 rollouts or a broken weight sync show up here)."""
    if not per_update or not samples or any(v != version for s in samples for v in s.versions):
        return {}
    first = per_update[0]
    return {"logprob_mismatch/kl_k3": first.get("kl/k3"), "logprob_mismatch/kl_k1": first.get("kl/k1"),
            "logprob_mismatch/ratio_max": first.get("ratio/max"), "logprob_mismatch/ratio_min": first.get("ratio/min")}


def recompute_behaviour_logprobs(trainers, groups) -> None:
    """The released code's choice: behaviour log-probs from the trainer at the generating weights."""
    import ray
    import torch

    from m2po_megatron.actor.batch import TrainBatch

    samples = [s for g in groups for s in g.samples if s.output_ids and s.finish_reason != "abort"]
    if not samples:
        return
    batch = TrainBatch(input_ids=[torch.tensor(s.prompt_ids + s.output_ids) for s in samples],
                       prompt_lens=[len(s.prompt_ids) for s in samples])
    logps = trainers.call("compute_log_probs", ray.put(batch))[0]
    for s, lp in zip(samples, logps):
        s.logprobs = [float(x) for x in lp]


def should_sync(cfg: DictConfig, generator) -> bool:
    if cfg.staleness.mode != "bounded":
        return True  # synchronous modes generate with the latest weights
    return generator.ctl.needs_sync()


def push_weights(trainers, generator, version: int) -> dict:
    """Pause admission, push the trainer's weights to every server (the weight sync itself retracts and
    continues in-flight requests, or updates in flight), tell the staleness controller."""
    paused = generator_pause(generator)
    try:
        stats = sync_weights(trainers, version)
        if hasattr(generator, "ctl"):
            generator.ctl.on_sync(version)
    finally:
        generator_resume(generator, paused)
    return stats


def generator_pause(generator) -> bool:
    if hasattr(generator, "paused"):
        generator.paused.set()
        return True
    return False


def generator_resume(generator, paused: bool) -> None:
    if paused:
        generator.paused.clear()


def sync_weights(trainers, version: int) -> dict:
    stats = trainers.call("sync_weights", version, timeout=1800)[0]
    return {f"weight_sync/{k}": v for k, v in stats.items() if isinstance(v, (int, float))}


def rewards_stats(generator) -> dict:
    """Reward-pool counters since the previous step (timeouts, errors, verdicts)."""
    with generator.maker.reward_lock:
        stats, generator.maker.reward_stats = generator.maker.reward_stats, {}
    return stats


def gen_throughput(generator, t_step_start: float) -> float:
    """Generated tokens per second of wall time since the previous call (all servers together)."""
    now, tokens = time.perf_counter(), generator.maker.gen_tokens
    last_t, last_tokens = getattr(generator, "_tp_mark", (t_step_start, 0))
    generator._tp_mark = (now, tokens)
    return (tokens - last_tokens) / max(now - last_t, 1e-9)


class _LockedRewards:
    """The run's reward pool, shared with the generation thread (one caller at a time)."""

    def __init__(self, pool, lock):
        self.pool, self.lock = pool, lock

    def score(self, responses, answers):
        with self.lock:
            return self.pool.score(responses, answers)


def evaluate(cfg: DictConfig, client, tokenizer, eval_sets: list, rdir: Path, step: int, generator) -> dict:
    """avg@k pass@1 per benchmark through the rollout engines, at the weights the servers hold (the loop
    syncs them to the trainer's first); tables in RUN_DIR/eval/."""
    from m2po_megatron.eval.benchmarks import evaluate as run_eval
    from m2po_megatron.eval.rollout_generate import rollout_generate_fn

    e = cfg.eval
    res = run_eval(rollout_generate_fn(client, seed=cfg.run.seed + 7919 * step), tokenizer, eval_sets,
                   temperature=e.temperature, top_p=e.top_p,
                   max_new_tokens=e.max_new_tokens or cfg.rollout.max_new_tokens,
                   reward_pool=_LockedRewards(generator.maker.rewards, generator.maker.reward_lock),
                   out_dir=rdir, step=step)
    return {**res.metrics(), "time/eval": res.seconds}


# ----------------------------------------------------------------------------------------------------
# Checkpoint and resume
# ----------------------------------------------------------------------------------------------------
def save_checkpoint(ckpts, step, version, trainers, prompts, ledger, generator) -> Path:
    from m2po_megatron.run_state import capture_rng_state, save_run_state

    with generator.lock:  # one consistent cut of the ledger and what the generator holds
        state = {"step": step, "version": version, "prompts": prompts.state_dict(),
                 "ledger": ledger.state_dict(), "generator": generator.state_dict(), "rng": capture_rng_state()}
    tmp = ckpts.begin(step)
    trainers.call("save", str(tmp / "megatron"), timeout=1800)
    save_run_state(tmp / "run_state.json", state)
    return ckpts.commit(step)


def restore(path: Path, trainers, prompts, ledger, generator) -> tuple[int, int]:
    from m2po_megatron.run_state import load_run_state, restore_rng_state

    state = load_run_state(Path(path) / "run_state.json")
    restore_rng_state(state["rng"])
    trainers.call("load", str(Path(path) / "megatron"), timeout=1800)
    prompts.load_state_dict(state["prompts"])
    ledger.load_state_dict(state["ledger"])
    generator.load_state_dict(state["generator"])
    return int(state["step"]), int(state["version"])

