"""Paths resolve by one rule (config/paths.py, docs/training.md "Paths"): written in a file, relative to that
file's folder or, when they start at a project folder, to the project; given on the command line, relative to
the working directory. The CLI run from another directory gives what it gives from the project root."""
import os
from pathlib import Path

import pytest
import yaml

from m2po_megatron.cli import main
from m2po_megatron.config import ConfigError, load_config
from m2po_megatron.config.paths import PROJECT_ROOT, resolve_override, written_path

REPO = Path(__file__).resolve().parents[2]


def test_the_rule(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    here = tmp_path / "task"
    assert written_path("train.jsonl", here) == str(here / "train.jsonl")  # the file's folder
    assert written_path("../shared/x.py", here) == str(tmp_path / "shared" / "x.py")
    assert written_path(".cache/tiny-task", here) == str(REPO / ".cache" / "tiny-task")  # a project folder
    assert written_path("./data/a.jsonl", here) == str(here / "data" / "a.jsonl")  # ./ : the file's, always
    assert written_path("/abs/a.jsonl", here) == "/abs/a.jsonl"
    assert written_path("~/a.jsonl", here) == os.path.expanduser("~/a.jsonl")
    assert written_path(".cache/tiny-task", None) == str(tmp_path / ".cache" / "tiny-task")  # command line: cwd
    # an oc.env default is written in the file; the variable's value is the shell's, left as OmegaConf reads it
    assert written_path("${oc.env:M2PO_DATA_DIR,data}/t.jsonl", here) == f"${{oc.env:M2PO_DATA_DIR,{REPO}/data}}/t.jsonl"
    assert written_path("${run.name}/x", here) == "${run.name}/x"


def test_overrides_written_in_a_sweep_file(tmp_path):
    assert resolve_override("model.hf_path=.cache/t", tmp_path) == f"model.hf_path={REPO}/.cache/t"
    assert resolve_override("data.eval_paths=[e.jsonl, ./f.jsonl]", tmp_path) == \
        f'data.eval_paths=["{tmp_path}/e.jsonl", "{tmp_path}/f.jsonl"]'
    assert resolve_override("reward.function=r.py:score", tmp_path) == f"reward.function={tmp_path}/r.py:score"
    for kept in ("reward.function=math_verify", "run.resume=auto", "train.steps=3", "run.output_dir=runs/x"):
        assert resolve_override(kept, tmp_path) == kept  # not an input path: as written


def test_a_users_recipe_names_the_files_beside_it_from_any_directory(tmp_path, monkeypatch):
    task, elsewhere = tmp_path / "task", tmp_path / "elsewhere"
    (task / "data").mkdir(parents=True)
    elsewhere.mkdir()
    (tmp_path / "base.yaml").write_text(f"extends: {REPO}/recipes/tiny-cpu.yaml\ndata: {{eval_paths: [e.jsonl]}}\n")
    (task / "recipe.yaml").write_text(
        "extends: ../base.yaml\n"
        "data: {train_path: ./data/train.jsonl}\n"
        "reward: {function: reward.py:score, terms: [{function: reward.py:other}]}\n"
        "rollout: {function: agent.py:run}\n")
    (task / "reward.py").write_text("def score(response, token_ids, row, **args):\n    return 1.0\n\nother = score\n")
    (task / "agent.py").write_text("async def run(ctx):\n    return []\n")
    monkeypatch.chdir(elsewhere)
    cfg = load_config(task / "recipe.yaml", ["model.hf_config=cfg.json"], check_files=False)
    assert cfg.data.train_path == str(task / "data" / "train.jsonl")
    assert list(cfg.data.eval_paths) == [str(tmp_path / "e.jsonl")]  # the parent's, relative to the parent
    assert cfg.reward.function == f"{task}/reward.py:score" and cfg.reward.terms[0].function == f"{task}/reward.py:other"
    assert cfg.rollout.function == f"{task}/agent.py:run"
    assert cfg.model.hf_path == str(REPO / ".cache" / "tiny-task")  # tiny-cpu's, the project's
    assert cfg.model.hf_config == str(elsewhere / "cfg.json")  # the command line's: the working directory's
    assert cfg.run.output_dir == "runs"  # an output: the working directory's, as written


def cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("recipe", ["recipes/paper/qwen3-4b-base.yaml", "recipes/tiny-cpu.yaml",
                                    "examples/countdown/recipe.yaml"])
def test_config_from_another_directory_is_the_same(recipe, tmp_path, monkeypatch, capsys):
    """Files present or not, the result (config, or the same error and hint) does not depend on the working
    directory; where the tiny task is built, tiny-cpu validates from anywhere."""
    monkeypatch.chdir(REPO)
    at_root = cli(capsys, "config", recipe)
    monkeypatch.chdir(tmp_path)
    assert cli(capsys, "config", str(REPO / recipe)) == at_root
    if recipe.startswith("recipes/paper"):
        rc, out, _ = cli(capsys, "config", str(REPO / recipe), "--no-check-files")
        assert rc == 0 and yaml.safe_load(out)["model"]["hf_config"].startswith(str(REPO / "m2po_megatron/assets"))
    if recipe == "recipes/tiny-cpu.yaml" and (REPO / ".cache" / "tiny-task" / "config.json").is_file():
        assert at_root[0] == 0, at_root[2]  # a built task is never called missing


def test_sweep_dry_run_from_another_directory_is_the_same(tmp_path, monkeypatch, capsys):
    """The runs, recipes and overrides are the same; only the output directory (runs/..., an output) is the
    working directory's."""
    sweep = str(REPO / "recipes" / "sweeps" / "table1.yaml")
    monkeypatch.chdir(REPO)
    rc, at_root, err = cli(capsys, "sweep", sweep, "--dry-run")
    assert rc == 0, err
    assert at_root.count("task ") == 22 and "recipes/paper/qwen3-8b-base.yaml" in at_root
    monkeypatch.chdir(tmp_path)
    rc, elsewhere, err = cli(capsys, "sweep", sweep, "--dry-run")
    assert rc == 0, err
    assert elsewhere.replace(f"{tmp_path}/runs", "RUNS") == at_root.replace(f"{REPO}/runs", "RUNS")


def test_a_base_recipe_says_so_and_anchor_names_are_suggested(capsys):
    rc, _, err = cli(capsys, "config", str(REPO / "recipes" / "paper" / "base.yaml"))
    assert rc == 2 and "is a base that other recipes extend" in err and "qwen3-4b-base.yaml" in err
    assert "trainer GPUs" not in err  # not its layout, which only a model recipe completes
    with pytest.raises(ConfigError, match="did you mean 'optim.lr'"):
        load_config(None, ["optim.learnng_rate=1e-5"])
    with pytest.raises(ConfigError, match="did you mean 'rollout.n_samples_per_prompt'"):
        load_config(None, ["rollout.n=8"])  # verl's name


def test_a_missing_recipe_names_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="relative to the working directory"):
        load_config("recipes/nope.yaml")
    (tmp_path / "r.yaml").write_text("extends: nope.yaml\n")
    with pytest.raises(ConfigError, match=f"relative to the folder of the file naming it, {tmp_path}"):
        load_config(tmp_path / "r.yaml")
    assert PROJECT_ROOT == REPO
