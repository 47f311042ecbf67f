"""A resume never silently changes the run: a changed algorithm, staleness, model, layout or data stops the
real `m2po train` entry point before Ray (exit 2, each key named), `--allow-change` lets a deliberate
change through, safe keys pass, every start is recorded in config_history.jsonl, and `m2po report` labels
a run by what ran at each step. In-process, on run directories prepared without training."""
import json
import subprocess

import pytest

from m2po_megatron.config import ConfigError, load_config, redact
from m2po_megatron.run.config_guard import ABSENT, diff, is_safe, parse_allowed, refused
from m2po_megatron.run.config_history import (append_history, config_at, effective, label_over_time,
                                              read_history, segments)


# ---------------------------------------------------------------------------------------------------------
# The diff and its classification
# ---------------------------------------------------------------------------------------------------------
def test_changes_are_classified_safe_or_guarded():
    old = {"algo": {"name": "m2po", "m2po": {"tau": 0.04}}, "train": {"steps": 10}, "logging": {"trace": True},
           "eval": {"interval": 5, "n_samples": 4}, "reward": {"args": {"k": 1}}, "run": {"seed": 1},
           "gone": {"old_field": 1}}
    new = {"algo": {"name": "grpo", "m2po": {"tau": 0.02}}, "train": {"steps": 20}, "logging": {"trace": False},
           "eval": {"interval": 9, "n_samples": 8}, "reward": {"args": {"k": 2}}, "run": {"seed": 2}}
    got = {c.key: c.safe for c in diff(old, new)}
    assert got == {"run.seed": False, "algo.name": False, "algo.m2po.tau": False, "reward.args": False,
                   "train.steps": True, "eval.interval": True, "eval.n_samples": False, "logging.trace": True}
    assert list(got)[:2] == ["run.seed", "algo.name"]  # schema order
    # a field the old config predates counts as unchanged at its default, and is a change otherwise
    defaults = {"staleness": {"lag_steps": 0}}
    assert diff({}, {"staleness": {"lag_steps": 0}}, defaults) == []
    (c,) = diff({}, {"staleness": {"lag_steps": 3}}, defaults)
    assert c.text() == f"staleness.lag_steps: {ABSENT} -> 3" and not c.safe
    # unknown keys are guarded (safe-by-refusal); sections are matched whole, not by name prefix
    assert is_safe("logging.wandb_project") and is_safe("checkpoint.keep_last") and is_safe("rollout.port")
    assert not is_safe("rollout.temperature") and not is_safe("train.steps_extra") and not is_safe("optim.lr")


def test_a_saved_relative_path_equals_its_absolute_reload_but_not_another_file():
    """Runs saved before paths became absolute (config/paths.py) hold relative paths; a reload gives absolute
    ones. The same file is no change; another file, or the same name elsewhere in a non-path key, is."""
    old = {"data": {"train_path": "data/deepscaler/train.jsonl", "eval_paths": ["./data/e/a.jsonl"]},
           "run": {"name": "data/x"}}
    same = {"data": {"train_path": "/p/data/deepscaler/train.jsonl", "eval_paths": ["/p/data/e/a.jsonl"]},
            "run": {"name": "data/x"}}
    assert diff(old, same) == []
    other = {"data": {"train_path": "/p/data/other/train.jsonl", "eval_paths": ["/p/data/e/a.jsonl", "/b"]},
             "run": {"name": "/p/data/x"}}
    assert {c.key for c in diff(old, other)} == {"run.name", "data.train_path", "data.eval_paths"}


def test_allow_change_names_keys_sections_or_all_and_refuses_typos():
    changes = diff({"algo": {"name": "m2po"}, "staleness": {"mode": "bounded"}, "train": {"steps": 1}},
                   {"algo": {"name": "grpo"}, "staleness": {"mode": "on_policy"}, "train": {"steps": 2}})
    assert [c.key for c in refused(changes, ())] == ["algo.name", "staleness.mode"]
    assert [c.key for c in refused(changes, parse_allowed(["algo.name"]))] == ["staleness.mode"]
    assert refused(changes, parse_allowed(["algo.name,staleness"])) == []
    assert refused(changes, parse_allowed(["all"])) == []
    assert parse_allowed(["reward.args.k", " algo "]) == ("reward.args.k", "algo")
    with pytest.raises(ConfigError, match=r"--allow-change algo\.nmae: no such config key"):
        parse_allowed(["algo.name,algo.nmae"])


# ---------------------------------------------------------------------------------------------------------
# The history
# ---------------------------------------------------------------------------------------------------------
def _cfg(name, mode="bounded"):
    return {"algo": {"name": name}, "staleness": {"mode": mode, "max_staleness": 4, "lag_steps": 0},
            "train": {"updates_per_step": 4, "steps": 60}, "model": {"hf_path": "/m/Qwen3-1.7B"}}


def test_history_supersedes_what_a_resume_from_an_earlier_checkpoint_recomputes(tmp_path):
    (tmp_path / "config.yaml").write_text("algo: {name: m2po}\n")  # a run from before the history was kept
    append_history(tmp_path, _cfg("grpo"), 40, tmp_path / "checkpoints" / "step_0000040", ("algo.name",))
    append_history(tmp_path, _cfg("gspo"), 50)
    entries = read_history(tmp_path)
    assert [(e["start_step"], e["config"]["algo"]["name"]) for e in entries] == [(0, "m2po"), (40, "grpo"),
                                                                                 (50, "gspo")]
    assert entries[1]["allowed"] == ["algo.name"] and entries[1]["resumed_from"].endswith("step_0000040")
    # checkpoint 40 continues with what its resume chose; 30 with what trained it
    assert config_at(tmp_path, 40)[0]["algo"]["name"] == "grpo"
    assert config_at(tmp_path, 30)[0]["algo"]["name"] == "m2po"
    assert config_at(tmp_path, 55)[0]["algo"]["name"] == "gspo"
    with open(tmp_path / "config_history.jsonl", "a") as f:
        f.write('{"start_step": 45, "con')  # a line cut by a kill is skipped
    append_history(tmp_path, _cfg("m2po"), 45)  # resumed from 45: steps 46..50+ of gspo are recomputed
    assert [e["start_step"] for e in effective(read_history(tmp_path))] == [0, 40, 45]
    assert [(a, b, c["algo"]["name"]) for a, b, c in segments(tmp_path, 60)] == [(1, 40, "m2po"), (41, 45, "grpo"),
                                                                                  (46, 60, "m2po")]
    name = lambda c: c["algo"]["name"]  # noqa: E731
    assert label_over_time(tmp_path, name, 60) == "m2po (steps 1-40) -> grpo (steps 41-45) -> m2po (steps 46-60)"
    # gspo's steps were all recomputed: one value over the run, so no label
    assert label_over_time(tmp_path, lambda c: name(c) == "gspo", 60) is None
    assert config_at(tmp_path / "elsewhere", 3) == (None, str(tmp_path / "elsewhere" / "config.yaml"))


def test_report_labels_a_run_by_what_ran(tmp_path):
    import yaml

    from m2po_megatron.sweep.report import load_run

    run = tmp_path / "mixed"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(_cfg("grpo", "on_policy")))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 0.1}) + "\n" for s in range(61)))
    append_history(run, _cfg("m2po"), 0)
    append_history(run, _cfg("grpo", "on_policy"), 40, allowed=("algo.name", "staleness.mode"))
    r = load_run(run)
    assert r.method == "m2po (steps 1-40) -> grpo (steps 41-60)"  # never counted as GRPO
    assert r.staleness == "<=4 (steps 1-40) -> 0 (steps 41-60)"
    assert r.model == "Qwen3-1.7B"
    (run / "config_history.jsonl").unlink()  # an older run: labelled by config.yaml, as before
    assert (load_run(run).method, load_run(run).staleness) == ("grpo", "0")


# ---------------------------------------------------------------------------------------------------------
# `m2po train --resume` on a run directory prepared without training
# ---------------------------------------------------------------------------------------------------------
def _m2po(capsys, *args):
    """`m2po ARGS` in this process; the starts tested here end before Ray (refused, or nothing to do)."""
    import ray

    from m2po_megatron.cli import main

    capsys.readouterr()
    rc = main(list(args))
    out = capsys.readouterr()
    assert not ray.is_initialized(), "Ray was started"
    return subprocess.CompletedProcess(list(args), rc, out.out, out.err)


def _tree(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def stopped_run(tiny_task, tmp_path):
    """A run directory as a run of 5 steps stopped at its checkpoint of step 2 leaves it (the config written
    by the real start hook, a checkpoint the resume path accepts), and the overrides that made it."""
    from m2po_megatron.run.rundir import record_start
    from m2po_megatron.run.state import CheckpointManager

    args = [f"model.hf_path={tiny_task}", f"data.train_path={tiny_task / 'train.jsonl'}", "data.eval_paths=[]",
            f"run.output_dir={tmp_path}", "run.name=r", "train.steps=5", "rollout.api_key=hunter2"]
    cfg = load_config("tiny-cpu", args)
    rdir = tmp_path / "r"
    record_start(cfg, rdir, 0, None)
    ckpts = CheckpointManager(rdir / "checkpoints")
    (ckpts.begin(2) / "run_state.json").write_text("{}")
    ckpts.commit(2)
    (rdir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (0, 1, 2)))
    return rdir, args


def test_resume_that_changes_the_run_is_refused_naming_each_key(stopped_run, capsys):
    rdir, args = stopped_run
    before = _tree(rdir)
    p = _m2po(capsys, "train", "tiny-cpu", *args, "algo.name=grpo", "staleness.mode=on_policy",
              "rollout.api_key=s3cret", "--resume", "auto")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "algo.name: 'm2po' -> 'grpo'" in p.stderr and "staleness.mode: 'bounded' -> 'on_policy'" in p.stderr
    assert "--allow-change algo.name,staleness.mode" in p.stderr and "from step 2" in p.stderr
    assert "Traceback" not in p.stderr and "s3cret" not in p.stderr + p.stdout and "hunter2" not in p.stderr
    assert _tree(rdir) == before  # nothing written
    p = _m2po(capsys, "train", "tiny-cpu", *args, "algo.name=grpo", "--allow-change", "algo.nmae", "--resume", "auto")
    assert p.returncode == 2 and "algo.nmae: no such config key" in p.stderr, p.stderr


def test_safe_and_allowed_changes_pass_the_guard(stopped_run, capsys):
    """train.steps=2 makes the run complete at its checkpoint: the start passes the guard, then stops with
    "nothing to do" before Ray, so what passed is visible without training."""
    rdir, args = stopped_run
    p = _m2po(capsys, "train", "tiny-cpu", *args, "train.steps=2", "eval.interval=7", "logging.trace=false",
              "--resume", "auto")
    assert p.returncode == 0 and "nothing to do" in p.stdout, p.stdout + p.stderr
    assert "resume changes train.steps: 5 -> 2 (safe)" in p.stdout and "eval.interval: 10 -> 7 (safe)" in p.stdout
    p = _m2po(capsys, "train", "tiny-cpu", *args, "train.steps=2", "algo.name=grpo", "optim.lr=2e-6",
              "--allow-change", "algo.name", "--allow-change", "optim", "--resume", "auto")
    assert p.returncode == 0 and "nothing to do" in p.stdout, p.stdout + p.stderr
    assert "algo.name: 'm2po' -> 'grpo' (allowed by --allow-change)" in p.stdout
    assert len(read_history(rdir)) == 1  # a start that did nothing records nothing


def test_a_recorded_start_is_the_next_resumes_reference(stopped_run):
    """After an allowed switch at step 2, a restart from that checkpoint (a requeued job) with the new
    settings passes without --allow-change; going back to the old ones is a change again."""
    from m2po_megatron.run.rundir import check_resume, record_start

    rdir, args = stopped_run
    ckpt = rdir / "checkpoints" / "step_0000002"
    grpo = load_config("tiny-cpu", [*args, "algo.name=grpo", "run.resume=auto"])
    assert check_resume(grpo, ckpt, ("algo.name",)) == ("algo.name",)
    record_start(grpo, rdir, 2, ckpt, ("algo.name",))
    assert check_resume(grpo, ckpt) == ()
    with pytest.raises(ConfigError, match=r"algo\.name: 'grpo' -> 'm2po'"):
        check_resume(load_config("tiny-cpu", [*args, "run.resume=auto"]), ckpt)
    history = read_history(rdir)
    assert [(e["start_step"], e["allowed"]) for e in history] == [(0, []), (2, ["algo.name"])]
    assert history[1]["config"] == redact(grpo) and history[1]["config"]["rollout"]["api_key"] == "***"
    assert "grpo" in (rdir / "config.yaml").read_text()  # config.yaml: the latest
