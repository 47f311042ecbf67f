"""Checkpoint and resume of a run from the driver: one consistent cut of the trainer's state (Megatron's
distributed checkpoint) and the loop's (step, version, prompt position, ledger, generator, RNG)."""
from __future__ import annotations

from pathlib import Path


def checkpoint_step(path) -> int:
    """The step a checkpoint to resume from holds (0: none, start fresh)."""
    from m2po_megatron.run.state import CheckpointManager

    return 0 if path is None else CheckpointManager.step_of(path)


def resume_hint(ckpts) -> str:
    latest = ckpts.latest()
    return (f"Resume from {latest} with `--resume auto`." if latest else
            "No checkpoint was written yet; start again (with --overwrite).")


def save_checkpoint(ckpts, step, version, trainers, prompts, ledger, generator) -> Path:
    from m2po_megatron.run.state import capture_rng_state, save_run_state

    with generator.locked():  # one consistent cut of the ledger and what the generator holds
        state = {"step": step, "version": version, "prompts": prompts.state_dict(),
                 "ledger": ledger.state_dict(), "generator": generator.state_dict(), "rng": capture_rng_state()}
    tmp = ckpts.begin(step)
    trainers.call("save", str(tmp / "megatron"), what=f"saving the checkpoint of step {step}")
    save_run_state(tmp / "run_state.json", state)
    return ckpts.commit(step)


def restore(path: Path, trainers, prompts, ledger, generator) -> tuple[int, int]:
    import ray

    from m2po_megatron.run.state import RunStateError, load_run_state, restore_rng_state

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
