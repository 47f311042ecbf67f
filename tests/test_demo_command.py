"""`m2po demo` reuses a built tiny task only when it was built with the demo's seed and warm-up target."""
import json

from m2po_megatron.commands.demo import DEMO_TARGET_ACCURACY, task_is_current
from m2po_megatron.demo.tiny_model import INFO_FILE


def _write(tmp_path, info):
    (tmp_path / INFO_FILE).write_text(info if isinstance(info, str) else json.dumps(info))
    return tmp_path


def test_a_task_built_for_the_demo_is_reused(tmp_path):
    assert task_is_current(_write(tmp_path, {"seed": 0, "target_accuracy": DEMO_TARGET_ACCURACY}), 0)


def test_an_older_or_other_task_is_rebuilt(tmp_path):
    assert not task_is_current(tmp_path, 0)  # nothing built
    assert not task_is_current(_write(tmp_path, {"seed": 0, "target_accuracy": 0.25}), 0)  # an older demo's
    assert not task_is_current(_write(tmp_path, {"seed": 1, "target_accuracy": DEMO_TARGET_ACCURACY}), 0)
    assert not task_is_current(_write(tmp_path, '{"seed": 0, "target_'), 0)  # cut off mid-write
    assert not task_is_current(_write(tmp_path, "[1, 2]"), 0)


def test_a_task_built_now_starts_the_demo_over_and_the_user_still_wins(tmp_path):
    """An earlier demo's finished run is resumed (reported) while its task is current; once the task was
    rebuilt, the run is started over instead of resuming a checkpoint of another model."""
    from m2po_megatron.commands.demo import demo_overrides
    from m2po_megatron.config import load_config, run_dir
    from m2po_megatron.run.rundir import check_run_dir
    from m2po_megatron.run.state import CheckpointManager

    task = tmp_path / "task"
    out = [f"run.output_dir={tmp_path / 'runs'}"]

    def resumes_from(built_now, user=()):
        cfg = load_config("tiny-cpu", demo_overrides(task, built_now, [*out, *user]), check_files=False)
        rdir = run_dir(cfg)
        return cfg, check_run_dir(cfg, rdir, CheckpointManager(rdir / "checkpoints"))

    earlier = CheckpointManager(tmp_path / "runs" / "tiny-cpu" / "checkpoints")
    (earlier.begin(50) / "model.pt").write_bytes(b"weights of the old task's model")
    ckpt = earlier.commit(50)

    cfg, resume_from = resumes_from(built_now=False)
    assert (cfg.run.resume, cfg.run.overwrite, resume_from) == ("auto", False, ckpt)
    assert cfg.model.hf_path == str(task) and cfg.data.train_path == str(task / "train.jsonl")
    cfg, resume_from = resumes_from(built_now=True)
    assert cfg.run.overwrite and resume_from is None  # moved aside by claim_run_dir, not resumed
    cfg, resume_from = resumes_from(built_now=True, user=["run.overwrite=false"])
    assert not cfg.run.overwrite and resume_from == ckpt
