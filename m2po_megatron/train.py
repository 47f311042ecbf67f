"""`m2po train`: the RL loop, top to bottom.

Ray placement -> data -> generation -> rewards -> advantages -> staleness gating -> training -> weight
sync -> evaluation -> logging -> checkpoints. Each algorithmic hook is a named function below or in the
module that owns it (samples.build_step_batch, generation.*, staleness.*, algo.*)."""
from __future__ import annotations

import json
import random
import signal
import time
import uuid
from pathlib import Path

from omegaconf import DictConfig

from m2po_megatron.actor.options import actor_kwargs
from m2po_megatron.config import as_plain, run_dir, save_resolved, secret
from m2po_megatron.run.metrics import MetricsLogger, Progress


def train(cfg: DictConfig) -> Path:
    from m2po_megatron.infra.cluster import init_ray, shutdown_ray
    from m2po_megatron.run.state import CheckpointManager, install_sigterm_flag
    from m2po_megatron.staleness import SampleLedger

    rdir = run_dir(cfg)
    ckpts = CheckpointManager(rdir / "checkpoints", keep_last=cfg.checkpoint.keep_last)
    stop = install_sigterm_flag(timeout_s=cfg.checkpoint.stop_timeout_s)  # honoured during set-up too
    try:  # everything the run needs is read and checked before anything is written or Ray starts
        resume_from = check_run_dir(cfg, rdir, ckpts)
        tokenizer = load_tokenizer(cfg)
        prompts, eval_rows = load_data(cfg, tokenizer)
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
    save_resolved(cfg, rdir)
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
        lock.release()
        stop.restore()
        if e.code != signal.SIGTERM:
            raise
        print(f"[m2po] stopped by SIGTERM while Ray started, before training; {resume_hint(ckpts)}", flush=True)
        return rdir
    stop.install()  # ray.init put its own SIGTERM handler (sys.exit) over ours
    engines = trainers = generator = rewards = client = None
    try:
        engines, urls = start_rollout_engines(cfg, rdir)
        client = make_client(cfg, urls)
        trainers = start_trainers(cfg, world, rdir, ckpts)
        init_weight_sync(cfg, trainers, urls)
        rewards = make_reward_pool(cfg)
        ledger = SampleLedger()
        generator = make_generator(cfg, client, rewards, tokenizer, prompts, ledger, trainers)
        step, version = 0, 0
        if resume_from is not None:
            step, version = restore(resume_from, trainers, prompts, ledger, generator)
            push_weights(trainers, generator, version)  # new servers hold the base weights
        saved = step  # the step of the latest checkpoint of this run
        if step == 0 and eval_rows and not stop.requested:  # the starting point, before generation competes
            logger.log(report_eval(evaluate(cfg, client, tokenizer, eval_rows, rdir, step, generator), 0), step=0)
        start_generation(generator)

        restarts = server_restarts(engines)
        U = cfg.train.updates_per_step
        progress = Progress(cfg.train.steps, "train", unit="step", initial=step)
        synced = version  # the version the servers hold
        while step < cfg.train.steps and not stop.requested:
            t0 = time.perf_counter()
            groups = next_batch(cfg, generator, version, ckpts)  # blocks until a batch may be trained
            t_wait = time.perf_counter() - t0

            with generator.lock:  # the generation thread writes the ledger too
                sb = build_batch(cfg, groups, version, ledger)  # advantages, staleness gating, ledger
            t1 = time.perf_counter()
            out = train_on(cfg, trainers, sb.batch)
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
                metrics.update(report_eval(evaluate(cfg, client, tokenizer, eval_rows, rdir, step, generator), step))
            logger.log(metrics, step=step)
            progress.update(postfix=f"reward {metrics.get('reward/mean', float('nan')):.3f} "
                                    f"staleness {metrics.get('staleness/mean', 0):.1f}")
            if cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0:
                save_checkpoint(ckpts, step, version, trainers, prompts, ledger, generator)
                saved = step

        progress.close()
        if stop.requested:
            if cfg.checkpoint.save_on_sigterm and step > saved:
                print(f"[m2po] {stop.signal_name} received: checkpointing at step {step} and exiting", flush=True)
                save_checkpoint(ckpts, step, version, trainers, prompts, ledger, generator)
            latest = ckpts.latest()
            print(f"[m2po] stopped by {stop.signal_name} at step {step}/{cfg.train.steps}; "
                  + (f"latest checkpoint {latest}; continue with `--resume auto`" if latest else
                     "no checkpoint yet (stopped before the first step)"), flush=True)
        else:
            if step > saved:
                save_checkpoint(ckpts, step, version, trainers, prompts, ledger, generator)
            if eval_rows and not (cfg.eval.interval and step % cfg.eval.interval == 0):
                if synced != version:
                    push_weights(trainers, generator, version)
                logger.log(report_eval(evaluate(cfg, client, tokenizer, eval_rows, rdir, step, generator), step),
                           step=step)
    finally:
        stop.leaving = True  # a signal now cannot cut the cleanup short (a hung one still ends)
        for closer in (generator, rewards, client):
            if closer is not None:
                closer.close()
        if trainers is not None:
            trainers.kill()
        if engines is not None:
            engines.shutdown()
        logger.close()
        shutdown_ray()
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


def check_run_dir(cfg: DictConfig, rdir: Path, ckpts):
    """The checkpoint to resume from (None: start fresh), checked, and the refusal to start a new run over
    another one. Reads only."""
    from m2po_megatron.run.rundir import refuse_if_used

    if cfg.run.overwrite:  # start over: whatever is there is moved aside (claim_run_dir)
        return None
    resume_from = ckpts.resolve_resume(cfg.run.resume)  # a damaged checkpoint is found here (RunStateError)
    if cfg.run.resume == "none":
        refuse_if_used(rdir)
    return resume_from


def check_ports(cfg: DictConfig) -> None:
    """A fixed rollout.port on this machine must be free now (port 0, the default, always is)."""
    import socket

    from m2po_megatron.config import ConfigError

    r = cfg.rollout
    if r.urls or not r.port or not r.host or cfg.cluster.ray_address != "local":
        return
    for port in range(r.port, r.port + r.num_servers):
        with socket.socket(socket.AF_INET6 if ":" in r.host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((r.host, port))
            except OSError as e:
                raise ConfigError(f"rollout.port = {r.port}: port {port} on {r.host} is in use ({e.strerror}); use "
                                  f"rollout.port=0 (each server binds a free port) or another port") from None


def checkpoint_step(path) -> int:
    return 0 if path is None else int(Path(path).name.split("_")[-1])


def claim_run_dir(cfg: DictConfig, rdir: Path, ckpts, resume_from):
    """Take the directory's lock; --overwrite moves an old run aside; a resume drops what came after its
    checkpoint (metrics rows, newer checkpoints), so every step is logged once."""
    from m2po_megatron.run.rundir import RunDirLock, move_aside, truncate_metrics

    if cfg.run.overwrite and rdir.exists():
        old = RunDirLock(rdir).acquire()  # not while another process runs in it
        moved = move_aside(rdir)
        old.release()
        if moved:
            print(f"[m2po] --overwrite: the previous run in {rdir} was moved to {moved}", flush=True)
    lock = RunDirLock(rdir).acquire()
    step = checkpoint_step(resume_from)
    if resume_from is not None and Path(resume_from).parent.resolve() == ckpts.root.resolve():
        for p in ckpts.retire_newer(step):
            print(f"[m2po] resuming from step {step}: the later checkpoint {p.name} is kept aside, not resumed",
                  flush=True)
    dropped = truncate_metrics(rdir / "metrics.jsonl", step if resume_from is not None else 0)
    if dropped:
        print(f"[m2po] metrics.jsonl: {dropped} row(s) after step {step} removed (they are recomputed)", flush=True)
    if resume_from is not None:
        print(f"[m2po] resuming from {resume_from} (step {step})", flush=True)
    return lock


def load_tokenizer(cfg: DictConfig):
    from transformers import AutoTokenizer

    from m2po_megatron.config import ConfigError

    ref = cfg.model.tokenizer or cfg.model.hf_path
    try:
        return AutoTokenizer.from_pretrained(ref)
    except (OSError, ValueError) as e:
        key = "model.tokenizer" if cfg.model.tokenizer else "model.hf_path"
        raise ConfigError(f"{key} = {ref!r}: no tokenizer could be loaded ({str(e).splitlines()[0]}); give a "
                          f"directory with tokenizer files (or set model.tokenizer)") from None


def load_data(cfg: DictConfig, tokenizer):
    """The training prompts and eval sets, read and checked (rows, prompt lengths) before Ray starts, each
    prompt the exact text the model sees (data.prompt_template and the chat template applied the same way
    to both; see data.prepare.final_prompts). A bad file is a ConfigError naming the field, file and row."""
    from m2po_megatron.config import ConfigError
    from m2po_megatron.data.prepare import final_prompts
    from m2po_megatron.eval.benchmarks import EvalSet
    from m2po_megatron.rollout.generators import PromptStream, Tokenize, load_prompt_rows

    d = cfg.data
    if not d.train_path:
        raise ConfigError("data.train_path is not set; prepare data with `m2po prepare-data`")
    tokenize = Tokenize(tokenizer, d.max_prompt_len)
    files = [("data.train_path", d.train_path)]
    files += [(f"data.eval_paths[{i}]", p) for i, p in enumerate(d.eval_paths)]
    loaded = []
    for key, path in files:
        try:
            rows = final_prompts(load_prompt_rows(path), template=d.prompt_template, tokenizer=tokenizer,
                                 apply_chat_template=d.apply_chat_template, source=path)
        except ValueError as e:
            raise ConfigError(f"{key}: {e}") from None
        for row in rows:
            try:
                tokenize(row["prompt"])
            except Exception as e:  # noqa: BLE001 - a tokenizer may fail in many ways on odd text
                raise ConfigError(f"{key}: {path}: row {row['id']}: {e}") from None
        loaded.append(rows)
    try:
        prompts = PromptStream(loaded[0], d.shuffle_seed)
        e = cfg.eval
        eval_sets = []
        for path, rows in zip(d.eval_paths, loaded[1:]):
            name = Path(path).name.split(".")[0]
            eval_sets.append(EvalSet(name, rows, e.n_samples_overrides.get(name, e.n_samples)))
    except ValueError as e:
        raise ConfigError(f"data: {e}") from None
    return prompts, eval_sets


def start_rollout_engines(cfg: DictConfig, rdir: Path):
    """Launch the servers as Ray actors on the `rollout` nodes (SGLang on GPUs, our CPU server otherwise),
    or attach to rollout.urls. Returns (manager or None, urls)."""
    import ray

    from m2po_megatron.infra.cluster import ROLLOUT_RESOURCE
    from m2po_megatron.rollout.launcher import EngineManager, ServerSpec

    r = cfg.rollout
    api_key = secret(r.api_key, "M2PO_API_KEY")
    if r.urls:
        return None, EngineManager.attach(list(r.urls), api_key=api_key, timeout_s=r.health_timeout_s)
    from m2po_megatron.run.state import RunError

    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["Resources"].get(ROLLOUT_RESOURCE)]
    if not nodes:
        raise RunError(f"no Ray node offers the '{ROLLOUT_RESOURCE}' resource for rollout servers; start "
                       f"rollout nodes with --resources='{{\"{ROLLOUT_RESOURCE}\": N}}' (slurm/ does)")
    # Each server carries this run's identity; the launcher checks it before the run uses a server, so a
    # run never talks to another run's server. Port 0: the launcher binds a free port itself.
    identity = f"m2po-{uuid.uuid4().hex[:12]}"
    specs = [ServerSpec(model_path=str(Path(cfg.model.hf_path).resolve()), engine=r.engine, host=r.host or "auto",
                        port=r.port + i if r.port else 0, tp_size=r.tp_size, dp_size=r.dp_size,
                        mem_fraction_static=r.mem_fraction_static, context_length=r.context_length,
                        dtype=r.dtype, quantization=r.quantization, api_key=api_key,
                        random_seed=cfg.run.seed + i, weight_version="0", served_model_name=identity,
                        enable_deterministic_inference=r.deterministic_inference)
             for i in range(r.num_servers)]
    pinned = [nodes[i % len(nodes)] for i in range(r.num_servers)]
    mgr = EngineManager(specs, run_dir=str(rdir), use_ray=True, max_restarts=r.max_restarts,
                        health_timeout_s=r.health_timeout_s, node_ids=pinned,
                        num_cpus_per_server=0, env={"OMP_NUM_THREADS": "1"})
    urls = mgr.start()
    by_id = {n["NodeID"]: n for n in ray.nodes()}
    placed = [{"server": i, "node": by_id[nid]["NodeManagerHostname"], "ip": by_id[nid]["NodeManagerAddress"],
               "url": url, "pid": info["pid"], "actor_pid": info["actor_pid"], "identity": identity}
              for i, (nid, url, info) in enumerate(zip(pinned, urls, mgr.info()))]
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


def start_trainers(cfg: DictConfig, world: int, rdir: Path, ckpts) -> "Ranks":
    """One Ray actor per Megatron rank on the `trainer` nodes; on GPUs, one placement group per node holding
    gpus_per_node consecutive ranks (whole tensor-parallel groups)."""
    import ray

    from m2po_megatron.infra.cluster import PlacementTimeout, RankGroup
    from m2po_megatron.run.state import RunError
    from m2po_megatron.actor.worker import TrainerWorker

    gpus = cfg.cluster.gpus_per_node
    try:
        group = RankGroup(TrainerWorker, world, gpus_per_rank=1 if gpus else 0, ranks_per_node=gpus or None,
                          placement_timeout_s=cfg.cluster.timeout_s, timeout_s=cfg.cluster.timeout_s,
                          env={"OMP_NUM_THREADS": 1, "M2PO_TRAINER_THREADS": 1})
    except PlacementTimeout as e:
        raise RunError(f"placing {world} trainer ranks: {e} (cluster.timeout_s)") from None
    except ray.exceptions.GetTimeoutError:
        raise RunError(f"placing {world} trainer ranks: not placed within cluster.timeout_s = "
                       f"{cfg.cluster.timeout_s:.0f} s; do enough Ray nodes offer the 'trainer' resource"
                       f"{' and GPUs' if gpus else ''}?") from None
    trainers = Ranks(group, ckpts, cfg.cluster.timeout_s)
    nodes = trainers.call("setup", actor_kwargs(cfg), what="building the Megatron ranks")
    record_placement(rdir, "trainer", [{"rank": n["rank"], "node": n["hostname"], "ip": n["ip"], "pid": n["pid"]}
                                       for n in nodes])
    return trainers


def init_weight_sync(cfg: DictConfig, trainers, urls: list[str], generation: int = 0) -> None:
    r = cfg.rollout
    ranks = r.tp_size * r.dp_size if r.engine == "sglang" else 1  # a server's GPU ranks all join the group
    trainers.call("init_weight_sync", urls, secret(r.api_key, "M2PO_API_KEY"), r.bucket_mb, 0, r.pause_mode,
                  ranks, f"weight_update_group_{generation}", timeout=r.health_timeout_s,
                  what=f"forming the weight-sync group with the rollout servers {urls} (rollout.health_timeout_s)")


def server_restarts(engines) -> list[int]:
    return [] if engines is None else [i["restarts"] for i in engines.info()]


def wait_servers(cfg: DictConfig, engines, urls: list[str]) -> None:
    """Block until every server answers /health_generate; a server whose restart budget is spent ends
    the run with its URL and log."""
    from m2po_megatron.rollout.launcher import wait_healthy

    from m2po_megatron.run.state import RunError

    for info in engines.info():
        if info.get("last_error") and not info.get("alive"):
            raise RunError(f"rollout server {info['url']} is down and was not restarted: "
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


def rollout_sampling(cfg: DictConfig) -> dict:
    """SGLang sampling_params of every training request (the generator adds the per-group seed)."""
    r = cfg.rollout
    return {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k, "max_new_tokens": r.max_new_tokens}


def make_generator(cfg, client, rewards, tokenizer, prompts, ledger, trainers):
    from m2po_megatron.rollout.generators import AsyncGenerator, GroupMaker, SyncGenerator, Tokenize
    from m2po_megatron.staleness import FixedLagQueue, StalenessController

    r, s, t = cfg.rollout, cfg.staleness, cfg.train
    maker = GroupMaker(client, rewards, tokenizer, Tokenize(tokenizer, cfg.data.max_prompt_len),
                       rollout_sampling(cfg), n=r.n_samples_per_prompt, seed=cfg.run.seed)
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
    from m2po_megatron.rollout.samples import build_step_batch

    s = cfg.staleness
    bound = s.max_staleness if s.mode == "bounded" else None
    return build_step_batch(groups, version, ledger, max_staleness=bound, drop_too_stale=s.drop_too_stale,
                            norm_by_std=cfg.algo.norm_adv_by_std, eps=cfg.algo.adv_eps)


def train_on(cfg: DictConfig, trainers, batch) -> dict:
    import ray

    if batch is None:  # every sample of the step was dropped (counted); nothing to train on
        return {}
    return trainers.call("train_step", ray.put(batch), cfg.train.updates_per_step, what="the train step")[0]


def next_batch(cfg: DictConfig, generator, version: int, ckpts):
    """The next batch of groups; a wait past cluster.timeout_s, or generation that failed for good (every
    server down past its restarts), stops the run with a RunError naming it."""
    from m2po_megatron.run.state import RunError

    try:
        return generator.next_groups(version, timeout_s=cfg.cluster.timeout_s)
    except (TimeoutError, RuntimeError) as e:
        raise RunError(f"waiting for rollouts: {e}; the run stops. {resume_hint(ckpts)}") from e


def resume_hint(ckpts) -> str:
    latest = ckpts.latest()
    return (f"Resume from {latest} with `--resume auto`." if latest else
            "No checkpoint was written yet; start again (with --overwrite).")


class Ranks:
    """The trainer ranks as the loop calls them: every call has a deadline (cluster.timeout_s unless given),
    and a rank that died or a deadline that passed becomes a RunError naming the call and the checkpoint
    to resume from. Errors raised inside a rank pass through (the caller knows what they mean)."""

    def __init__(self, group, ckpts, timeout_s: float):
        self.group, self.ckpts, self.timeout_s = group, ckpts, timeout_s

    def call(self, method: str, *args, timeout: float | None = None, what: str | None = None, **kwargs):
        import ray

        from m2po_megatron.run.state import RunError

        what = what or f"{method} on the trainer ranks"
        timeout = timeout or self.timeout_s
        try:
            return self.group.call(method, *args, timeout=timeout, **kwargs)
        except ray.exceptions.GetTimeoutError:
            raise RunError(f"{what}: no answer from the trainer ranks within {timeout:.0f} s; the run stops. "
                           f"{resume_hint(self.ckpts)}") from None
        except ray.exceptions.RayActorError as e:
            raise RunError(f"a trainer rank died during {what} ({e.__class__.__name__}); the run stops. "
                           f"{resume_hint(self.ckpts)}") from e

    def kill(self) -> None:
        self.group.kill()


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
    logps = trainers.call("compute_log_probs", ray.put(batch), what="recomputing behaviour log-probs")[0]
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
    stats = trainers.call("sync_weights", version, what=f"the weight sync of version {version}")[0]
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


def report_eval(metrics: dict, step: int) -> dict:
    """Print an evaluation's accuracy (the loop logs the same numbers); returns the metrics."""
    per = [f"{k.split('/')[1]} {v:.1f}%" for k, v in metrics.items()
           if k.endswith("/pass@1") and k != "eval/avg/pass@1"]
    print(f"[m2po] eval at step {step}: pass@1 {metrics.get('eval/avg/pass@1', float('nan')):.1f}% "
          f"({', '.join(per)})", flush=True)
    return metrics


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
    from m2po_megatron.run.state import capture_rng_state, save_run_state

    with generator.lock:  # one consistent cut of the ledger and what the generator holds
        state = {"step": step, "version": version, "prompts": prompts.state_dict(),
                 "ledger": ledger.state_dict(), "generator": generator.state_dict(), "rng": capture_rng_state()}
    tmp = ckpts.begin(step)
    trainers.call("save", str(tmp / "megatron"), what=f"saving the checkpoint of step {step}")
    save_run_state(tmp / "run_state.json", state)
    return ckpts.commit(step)


def restore(path: Path, trainers, prompts, ledger, generator) -> tuple[int, int]:
    from m2po_megatron.run.state import load_run_state, restore_rng_state

    import ray

    from m2po_megatron.run.state import RunStateError

    state = load_run_state(Path(path) / "run_state.json")
    restore_rng_state(state["rng"])
    try:
        trainers.call("load", str(Path(path) / "megatron"), what=f"loading the checkpoint {path}")
    except ray.exceptions.RayTaskError as e:  # a file the manifest could not catch (same size, bad bytes)
        cause = e.cause if getattr(e, "cause", None) is not None else e
        raise RunStateError(f"checkpoint {path} could not be loaded ({type(cause).__name__}: "
                            f"{str(cause).splitlines()[0] if str(cause) else ''}); resume from an earlier one "
                            f"(--resume PATH) or start over with --overwrite") from None
    prompts.load_state_dict(state["prompts"])
    ledger.load_state_dict(state["ledger"])
    generator.load_state_dict(state["generator"])
    return int(state["step"]), int(state["version"])

