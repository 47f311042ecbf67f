"""`m2po train`: the RL loop, top to bottom.

Ray placement -> data -> generation -> rewards -> advantages -> staleness gating -> training -> weight
sync -> evaluation -> logging -> checkpoints. The loop calls verbs on its components, each in the module of
its domain: the run directory (run/rundir.py) and checkpoints (run/checkpoint.py), the inputs
(run/inputs.py), the rollout servers (run/servers.py), the trainer ranks (run/trainers.py), the
generator (rollout/generators.py, one `Generator` interface for every staleness mode), weight updates of the
servers (rollout/updates.py), the colocated swap (run/colocation.py: cluster.colocate, the engines and the
trainer take turns on the same GPUs) and evaluation (eval/in_run.py). The algorithmic hooks of a step are below or
in the module that owns them (samples.build_step_batch, staleness.*, algo.*)."""
from __future__ import annotations

import random
import signal
import time
from pathlib import Path

from omegaconf import DictConfig

from m2po_megatron.config import as_plain, run_dir
from m2po_megatron.infra import trace
from m2po_megatron.run.metrics import MetricsLogger, Progress


def train(cfg: DictConfig, allow_change: tuple[str, ...] = ()) -> Path:
    """Run the loop; `allow_change`: config keys a resume may change beyond the safe ones (run/config_guard.py)."""
    from m2po_megatron.eval.in_run import Evaluator
    from m2po_megatron.infra.cluster import init_ray, shutdown_ray
    from m2po_megatron.reward import rewards_from_config
    from m2po_megatron.reward.checks import needs_label
    from m2po_megatron.rollout.generators import make_generator
    from m2po_megatron.rollout.updates import WeightUpdater
    from m2po_megatron.run.checkpoint import checkpoint_step, restore, resume_hint, save_checkpoint
    from m2po_megatron.run.colocation import Colocation
    from m2po_megatron.run.inputs import load_data, load_tokenizer
    from m2po_megatron.run.rundir import check_resume, check_run_dir, claim_run_dir, record_start
    from m2po_megatron.run.servers import api_key, check_ports, make_client, start_rollout_engines
    from m2po_megatron.run.state import CheckpointManager, install_sigterm_flag
    from m2po_megatron.run.trainers import start_trainers
    from m2po_megatron.staleness import SampleLedger

    rdir = run_dir(cfg)
    ckpts = CheckpointManager(rdir / "checkpoints", keep_last=cfg.checkpoint.keep_last)
    stop = install_sigterm_flag(timeout_s=cfg.checkpoint.stop_timeout_s)  # honoured during set-up too
    try:  # everything the run needs is read and checked before anything is written or Ray starts
        resume_from = check_run_dir(cfg, rdir, ckpts)
        changed = check_resume(cfg, resume_from, allow_change)  # a resume that changes the run stops here
        tokenizer = load_tokenizer(cfg)
        prompts, eval_rows = load_data(cfg, tokenizer, require_label=needs_label(cfg.reward))
        check_ports(cfg)
    except BaseException:
        stop.restore()
        raise
    start_step = checkpoint_step(resume_from)
    if start_step >= cfg.train.steps:
        print(f"[m2po] {rdir} is complete at step {start_step} (train.steps = {cfg.train.steps}); nothing to do. "
              f"Raise train.steps to continue it.", flush=True)
        stop.restore()
        return rdir
    lock = claim_run_dir(cfg, rdir, ckpts, resume_from)  # the directory is this process's until it exits
    record_start(cfg, rdir, start_step, resume_from, changed)  # config.yaml and config_history.jsonl
    if cfg.logging.trace:  # RUN_DIR/trace/loop.jsonl, merged into RUN_DIR/trace.json at the end
        trace.open_trace(rdir / "trace" / "loop.jsonl", "loop", cfg.logging.trace_limit)
    logger = MetricsLogger(rdir, config=as_plain(cfg), wandb_mode=cfg.logging.wandb_mode,
                           project=cfg.logging.wandb_project, entity=cfg.logging.wandb_entity,
                           name=cfg.run.name, resume=resume_from is not None, resume_step=start_step)
    seed_everything(cfg.run.seed)
    world = trainer_world_size(cfg)
    try:
        init_ray(cfg.cluster.ray_address, tmpdir=cfg.cluster.ray_tmpdir,
                 object_store_memory_mb=cfg.cluster.object_store_memory_mb, trainer_slots=world,
                 rollout_slots=cfg.rollout.num_servers)
    except SystemExit as e:  # SIGTERM during ray.init reaches Ray's handler (sys.exit(15)): nothing to save yet
        shutdown_ray()
        logger.close()
        trace.close_trace()
        lock.release()
        stop.restore()
        if e.code != signal.SIGTERM:
            raise
        print(f"[m2po] stopped by SIGTERM while Ray started, before training; {resume_hint(ckpts)}", flush=True)
        return rdir
    stop.install()  # ray.init put its own SIGTERM handler (sys.exit) over ours
    engines = trainers = generator = rewards = client = swap = None
    try:
        if cfg.cluster.colocate:  # the trainer is built, then offloaded: the engines start on its GPUs
            trainers = start_trainers(cfg, world, rdir, ckpts)
            trainers.offload()
        engines, urls = start_rollout_engines(cfg, rdir, trainers)
        client = make_client(cfg, urls)
        trainers = trainers or start_trainers(cfg, world, rdir, ckpts)
        weights = WeightUpdater(cfg, trainers, engines, urls, api_key(cfg))
        weights.connect()
        if cfg.cluster.colocate:
            swap = Colocation(cfg, trainers, weights, urls, api_key(cfg))
        rewards = rewards_from_config(cfg)
        ledger = SampleLedger()
        generator = make_generator(cfg, client, rewards, tokenizer, prompts, ledger, trainers)
        weights.attach(generator)
        evaluator = Evaluator(cfg, client, tokenizer, eval_rows, rdir, generator.eval_rewards())
        step, version = 0, 0
        if resume_from is not None:
            if swap is not None:
                swap.to_train()
            step, version = restore(resume_from, trainers, prompts, ledger, generator)
            if swap is not None:
                swap.to_generate(version)  # new servers hold the base weights
            else:
                weights.push(version)
        saved = step  # the step of the latest checkpoint of this run
        if step == 0 and evaluator.enabled and not stop.requested:  # the starting point, before generation competes
            with trace.span("eval", "eval", tid="loop", step=0):
                logger.log(evaluator(0, weights.synced), step=0)
        generator.start()

        weights.watch_restarts()
        U = cfg.train.updates_per_step
        progress = Progress(cfg.train.steps, "train", unit="step", initial=step)
        while step < cfg.train.steps and not stop.requested:
            t0 = time.perf_counter()
            groups, resynced = next_batch(cfg, generator, weights, version, ckpts)  # until a batch may be trained
            t_wait = time.perf_counter() - t0

            with generator.locked():  # the generation thread writes the ledger too
                sb = build_batch(cfg, groups, version, ledger)  # advantages, staleness gating, ledger
            swapped = swap.to_train() if swap is not None else {}  # colocated: engines release, trainer reloads
            t1 = time.perf_counter()
            kl_metrics = reward_kl(cfg, trainers, sb)  # the KL in the reward: advantages reshaped, if asked
            out = train_on(cfg, trainers, sb.batch)
            updates = out.pop("per_update", None)  # each optimizer update's own metrics, logged as a list
            out.update(logprob_mismatch(sb.samples, updates, version, out))
            t_train = time.perf_counter() - t1
            trace.complete("wait_rollout", "loop", t0, t0 + t_wait, tid="loop")
            trace.complete("train_step", "loop", t1, t1 + t_train, tid="loop", args={"step": step})
            applied = U if sb.batch is not None else 0  # a step whose samples were all dropped updates nothing
            version += applied
            step += 1
            generator.on_step(version, updates=applied)

            t2 = time.perf_counter()
            eval_now = evaluator.due(step)
            if swap is not None:  # colocated: engines take back weights, get `version`, trainer offloads, KV back
                sync_stats = swap.to_generate(version)
                swapped.update({k: sync_stats.pop(k) for k in list(sync_stats) if k.startswith("time/")})
            else:
                sync_stats = weights.resync_restarted(version)  # a restarted server holds the base weights
                if generator.needs_sync() or (eval_now and weights.synced != version):
                    sync_stats.update(weights.sync_or_recover(version))
            t_sync = time.perf_counter() - t2
            if sync_stats:
                trace.complete("weight_sync", "sync", t2, t2 + t_sync, tid="loop", args={"version": version})

            with generator.locked():
                accounting = ledger.end_step(pending=generator.pending())  # generated = consumed + dropped + pending
            gen = generator.stats(since=t0)
            if cfg.train.filter_groups.enable:  # a step that could not fill its batch says so
                gen.extra["filter_groups/unfilled_groups"] = cfg.train.prompts_per_step - len(groups)
            metrics = {"version": version, **sb.metrics, **kl_metrics, **out, **accounting, **gen.rewards, **gen.extra,
                       **resynced, **sync_stats,
                       "time/wait_rollout": t_wait, "time/train": t_train, "time/weight_sync": t_sync,
                       "time/step": time.perf_counter() - t0, **swapped, **({"updates": updates} if updates else {}),
                       "tokens_per_s/train": sb.metrics.get("batch/tokens", 0) / max(t_train, 1e-9),
                       "tokens_per_s/gen": gen.tokens_per_s}
            if eval_now:
                with trace.span("eval", "eval", tid="loop", step=step):
                    metrics.update(evaluator(step, weights.synced))
            logger.log(metrics, step=step)
            progress.update(postfix=f"reward {metrics.get('reward/mean', float('nan')):.3f} "
                                    f"staleness {metrics.get('staleness/mean', 0):.1f}")
            if cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0:
                with trace.span("checkpoint", "checkpoint", tid="loop", step=step):
                    with trainers.on_device():  # colocated: a swap around the save
                        save_checkpoint(ckpts, step, version, trainers, prompts, ledger, generator)
                saved = step

        progress.close()
        if stop.requested:
            if cfg.checkpoint.save_on_sigterm and step > saved:
                print(f"[m2po] {stop.signal_name} received: checkpointing at step {step} and exiting", flush=True)
                with trainers.on_device():
                    save_checkpoint(ckpts, step, version, trainers, prompts, ledger, generator)
            latest = ckpts.latest()
            print(f"[m2po] stopped by {stop.signal_name} at step {step}/{cfg.train.steps}; "
                  + (f"latest checkpoint {latest}; continue with `--resume auto`" if latest else
                     "no checkpoint yet (stopped before the first step)"), flush=True)
        else:
            if step > saved:
                with trace.span("checkpoint", "checkpoint", tid="loop", step=step):
                    with trainers.on_device():  # colocated: a swap around the save
                        save_checkpoint(ckpts, step, version, trainers, prompts, ledger, generator)
            if evaluator.enabled and not evaluator.due(step):  # not evaluated at this step yet
                if weights.synced != version:
                    weights.push(version)
                with trace.span("eval", "eval", tid="loop", step=step):
                    logger.log(evaluator(step, weights.synced), step=step)
    finally:
        stop.leaving = True  # a signal now cannot cut the cleanup short (a hung one still ends)
        for closer in (generator, rewards, client, swap):
            if closer is not None:
                closer.close()
        if trainers is not None:
            trainers.kill()
        if engines is not None:
            engines.shutdown()
        logger.close()
        shutdown_ray()
        trace.close_trace()
        try:
            trace.merge_trace(rdir)
        except (OSError, ValueError) as e:  # the parts stay; `m2po plot` reads them
            print(f"[m2po] could not write {rdir / 'trace.json'}: {e}", flush=True)
        lock.release()
        stop.restore()
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


# ----------------------------------------------------------------------------------------------------
# Per-step hooks
# ----------------------------------------------------------------------------------------------------
def build_batch(cfg: DictConfig, groups, version: int, ledger):
    from m2po_megatron.rollout.samples import build_step_batch

    s = cfg.staleness
    bound = s.max_staleness if s.mode == "bounded" else None
    return build_step_batch(groups, version, ledger, max_staleness=bound, drop_too_stale=s.drop_too_stale,
                            norm_by_std=cfg.algo.norm_adv_by_std, eps=cfg.algo.adv_eps,
                            overlong_filtering=cfg.algo.overlong_filtering)


def reward_kl(cfg: DictConfig, trainers, sb) -> dict:
    """algo.use_kl_in_reward: the reference's log-probs of the step's batch from the trainer ranks, and the
    batch's advantages recomputed from rewards less the KL penalty (algo/kl_reward.py); the batch keeps the
    reference log-probs, so the train step does not compute them again."""
    import ray
    import torch

    from m2po_megatron.algo.kl_reward import penalised_advantages

    a = cfg.algo
    if not a.use_kl_in_reward or sb.batch is None:
        return {}
    batch = sb.batch
    ref = trainers.call("reference_log_probs", ray.put(batch), what="the reference model's log-probs")[0]
    gids = {g: i for i, g in enumerate(dict.fromkeys(s.group_id for s in sb.samples))}
    rewards = torch.tensor([float(s.reward) for s in sb.samples])
    adv, metrics = penalised_advantages(rewards, torch.tensor([gids[s.group_id] for s in sb.samples]),
                                        batch.behav_log_probs, ref, coef=float(a.kl_ctrl.kl_coef),
                                        kl_type=a.kl_penalty, loss_mask=batch.loss_mask,
                                        norm_by_std=a.norm_adv_by_std, eps=a.adv_eps)
    batch.advantages, batch.ref_log_probs = adv, ref
    metrics["advantage/abs_mean"] = float(adv.abs().mean())
    return metrics


def train_on(cfg: DictConfig, trainers, batch) -> dict:
    import ray

    if batch is None:  # every sample of the step was dropped (counted); nothing to train on
        return {}
    return trainers.call("train_step", ray.put(batch), cfg.train.updates_per_step, what="the train step")[0]


RESTART_POLL_S = 5.0  # how often a bounded run waiting for rollouts looks for restarted servers


def next_batch(cfg: DictConfig, generator, weights, version: int, ckpts) -> tuple[list, dict]:
    """The next batch of groups, and the stats of any re-sync done while waiting for it. A wait past
    cluster.timeout_s, or generation that failed for good (every server down past its restarts), stops the
    run with a RunError naming it.

    A server that restarts while the loop waits here answers with its base weights, and the bounded generator
    drops those answers as older than the bound allows until the servers are re-synced; the end-of-step
    re-sync would never come, so the wait itself looks for restarts every RESTART_POLL_S and re-syncs.
    The synchronous modes generate inside `next_groups` (a short timeout would abandon their batch) and
    never drop on version, so they wait in one piece."""
    from m2po_megatron.run.checkpoint import resume_hint
    from m2po_megatron.infra.errors import RunError

    timeout = cfg.cluster.timeout_s
    poll = RESTART_POLL_S if cfg.staleness.mode == "bounded" else timeout
    deadline = time.monotonic() + timeout
    synced: dict = {}
    try:
        while True:
            try:
                left = max(deadline - time.monotonic(), 0.0)
                return generator.next_groups(version, timeout_s=min(poll, left)), synced
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"no batch within cluster.timeout_s = {timeout:.0f} s; are the rollout "
                                       f"servers alive?") from None
            synced.update(weights.resync_restarted(version))
    except (TimeoutError, RuntimeError) as e:
        raise RunError(f"waiting for rollouts: {e}; the run stops. {resume_hint(ckpts)}") from e


def logprob_mismatch(samples, per_update, version: int, out: dict | None = None) -> dict:
    """Behaviour (engine) vs trainer log-probs at the same weights: the first update of a step whose
    samples were all generated at the step's starting version sees exactly that pair (ratio = 1 up to
    numerics; bf16 or FP8 rollouts or a broken weight sync show up here). A three-policy step's losses see
    theta/proximal instead; there the correction's own proximal/behaviour metrics are that pair."""
    if not per_update or not samples or any(v != version for s in samples for v in s.policy_versions):
        return {}
    out = out or {}
    if "rollout_corr/kl_k1" in out:
        return {"logprob_mismatch/kl_k3": out["rollout_corr/kl_k3"], "logprob_mismatch/kl_k1": out["rollout_corr/kl_k1"],
                "logprob_mismatch/ratio_max": out["rollout_corr/ratio_max"],
                "logprob_mismatch/ratio_min": out["rollout_corr/ratio_min"]}
    first = per_update[0]
    return {"logprob_mismatch/kl_k3": first.get("kl/k3"), "logprob_mismatch/kl_k1": first.get("kl/k1"),
            "logprob_mismatch/ratio_max": first.get("ratio/max"), "logprob_mismatch/ratio_min": first.get("ratio/min")}
