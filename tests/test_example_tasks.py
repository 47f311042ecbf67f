"""The example tasks of docs/tasks.md: a task is one YAML file and one Python file, with no change to the package.

examples/countdown: the rule-based reward on hand-written answers, the data script reproducing the committed
files, the recipe validating and training for real (2 steps) on the tiny model. examples/code: the recipe
validating, and the `code` reward scoring the reference solutions 1 and broken ones 0. And `m2po train`'s
build of a missing tiny task (m2po_megatron/demo/autobuild.py): which paths it builds and which it leaves alone.
"""
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from m2po_megatron.demo.autobuild import BUILDS, TinyBuild, build_missing_tiny_task, build_tiny_task_at, tiny_task_dir
from m2po_megatron.demo.tiny_model import INFO_FILE

REPO = Path(__file__).resolve().parents[1]
COUNTDOWN = REPO / "examples" / "countdown"
CODE = REPO / "examples" / "code"
RUN_TIMEOUT = 900


def m2po(*args: str, cwd: Path, timeout: int = 300, **env_vars: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_AUTH_MODE="disabled", WANDB_MODE="disabled", **env_vars)
    return subprocess.run([sys.executable, "-m", "m2po_megatron.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


def ok(p: subprocess.CompletedProcess) -> None:
    assert p.returncode == 0, f"exit {p.returncode}\n--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-6000:]}"


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def countdown_reward():
    spec = importlib.util.spec_from_file_location("countdown_reward_example", COUNTDOWN / "reward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.countdown_reward


# ------------------------------------------------------------------------------------------------ countdown
ROW = {"numbers": [7, 1, 5], "target": 28}


@pytest.mark.parametrize("response, expect", [
    # right: an equation chain, an expression in the box, the same through a step's result, a subset of numbers
    ("5-1=4 4*7=28 \\boxed{28}", (1, 1, 1, 1)),
    ("\\boxed{(5-1)*7}", (1, 1, 1, 1)),
    ("\\boxed{7 \\times (5-1)}", (1, 1, 1, 1)),
    ("first 5-1=4 then 7*4=28, so \\boxed{28}", (1, 1, 1, 1)),
    # wrong: valid answers by the rules that miss the target (format_score), a chain ending elsewhere
    ("7+1=8 8+5=13 \\boxed{13}", (0.1, 0, 1, 1)),
    ("\\boxed{7*5-1}", (0.1, 0, 1, 1)),
    ("5-1=4 4*7=28 \\boxed{4}", (0, 0, 1, 0)),  # 4 was used up by the second step
    # arithmetic slips
    ("5-1=4 4*7=29 \\boxed{29}", (0, 0, 0, 1)),
    ("7+1=9 \\boxed{9}", (0, 0, 0, 1)),
    # reusing or inventing numbers
    ("7*7=49 49-21=28 \\boxed{28}", (0, 0, 1, 0)),
    ("\\boxed{7*4}", (0, 0, 1, 0)),
    ("\\boxed{(5-1)*7+1-1}", (0, 0, 1, 0)),
    ("\\boxed{28}", (0, 0, 0, 0)),  # the target alone, no work: not an answer
    ("\\boxed{7}", (0, 0, 0, 1)),  # a given number alone: not an answer either
    # malformed
    ("", (0, 0, 0, 0)),
    ("the answer is 28", (0, 0, 0, 0)),
    ("\\boxed{(5-1)*7", (0, 0, 0, 0)),  # cut off before the box closed
    ("\\boxed{(5-1)*7)}", (0, 0, 0, 0)),
    ("\\boxed{(5/1)*7}", (0, 0, 0, 0)),  # division is not allowed
    ("\\boxed{2**5}", (0, 0, 0, 0)),
    ("\\boxed{__import__('os')}", (0, 0, 0, 0)),
    ("\\boxed{" + "+".join(["1"] * 5000) + "}", (0, 0, 0, 0)),  # too deep to evaluate: malformed, not a crash
    ("1+1=2 \\boxed{" + "9" * 5000 + "}", (0, 0, 0, 0)),  # past Python's int-from-text limit
])
def test_countdown_reward_on_hand_written_answers(countdown_reward, response, expect):
    out = countdown_reward(response, [], dict(ROW), format_score=0.1)
    assert set(out) == {"score", "acc", "valid_expr", "uses_numbers"}
    assert (out["score"], out["acc"], out["valid_expr"], out["uses_numbers"]) == pytest.approx(expect)


def test_countdown_reward_follows_the_contract(countdown_reward):
    from m2po_megatron.reward.types import normalize

    row = {"numbers": [3, 3, 4], "target": "10"}  # a loader may hand the label over as text
    assert normalize(countdown_reward("3+3=6 6+4=10 \\boxed{10}", [1, 2], row))[0] == 1.0
    assert countdown_reward("3+3=6 6+4=10 \\boxed{10}", [], {"numbers": [3, 4], "target": 10})["score"] == 0.0
    assert countdown_reward("3+4=7 \\boxed{7}", [], row)["score"] == 0.0  # format_score defaults to 0
    assert row == {"numbers": [3, 3, 4], "target": "10"}  # the row is not consumed


def test_make_data_reproduces_the_committed_files(tmp_path):
    p = subprocess.run([sys.executable, str(COUNTDOWN / "make_data.py"), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    for name in ("train.jsonl", "eval.jsonl"):
        assert (tmp_path / name).read_bytes() == (COUNTDOWN / name).read_bytes(), name
    again = subprocess.run([sys.executable, str(COUNTDOWN / "make_data.py"), "--out", str(tmp_path / "s1"),
                            "--seed", "1"], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and (tmp_path / "s1" / "eval.jsonl").read_bytes() != (tmp_path / "eval.jsonl").read_bytes()


def test_the_committed_problems_are_solvable_distinct_and_disjoint(countdown_reward):
    train, evals = rows(COUNTDOWN / "train.jsonl"), rows(COUNTDOWN / "eval.jsonl")
    assert (len(train), len(evals)) == (512, 128)
    keys = lambda rs: {(tuple(sorted(r["numbers"])), r["target"]) for r in rs}  # noqa: E731
    assert len(keys(train)) == 512 and len(keys(evals)) == 128 and not keys(train) & keys(evals)
    for r in train + evals:
        assert countdown_reward(r["solution"], [], r)["score"] == 1.0, r
        assert r["prompt"] == f"Compute {','.join(map(str, r['numbers']))} = {r['target']}. Put the answer in \\boxed{{}}."
        assert r["target"] not in r["numbers"] and 1 <= r["target"] <= 99
    plain = sum(r["target"] == sum(r["numbers"]) for r in train) / len(train)
    assert 0.15 < plain < 0.4  # some targets a plain sum reaches: the tiny model's starting signal


def test_countdown_recipe_validates(tiny_task):
    """As written (its data and reward paths the project's examples/countdown/: config/paths.py), with the model
    pointed at a built tiny task."""
    p = m2po("config", str(COUNTDOWN / "recipe.yaml"), f"model.hf_path={tiny_task}", cwd=REPO)
    ok(p)
    cfg = yaml.safe_load(p.stdout)
    assert cfg["run"]["name"] == "countdown"
    assert cfg["reward"]["function"] == f"{COUNTDOWN / 'reward.py'}:countdown_reward"
    assert cfg["data"]["label_key"] == "target" and cfg["data"]["train_path"] == str(COUNTDOWN / "train.jsonl")
    assert cfg["model"]["hf_path"] == str(tiny_task)
    assert 30 <= cfg["train"]["steps"] <= 40 and cfg["rollout"]["engine"] == "local"


@pytest.fixture()
def small_countdown_eval(tmp_path):
    path = tmp_path / "countdown_eval.jsonl"
    path.write_text("\n".join((COUNTDOWN / "eval.jsonl").read_text().splitlines()[:8]) + "\n")
    return path


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_countdown_trains_for_two_steps(tiny_task, tmp_path, small_countdown_eval):
    """The recipe as a user runs it, shortened: the user's reward runs in the reward workers and its extras
    reach metrics.jsonl as reward/<key>."""
    from m2po_megatron.run.metrics import read_metrics

    p = m2po("train", str(COUNTDOWN / "recipe.yaml"), f"model.hf_path={tiny_task}", f"run.output_dir={tmp_path}",
             "train.steps=2", "train.prompts_per_step=8", "train.updates_per_step=2", "rollout.n_samples_per_prompt=4",
             f"data.eval_paths=[{small_countdown_eval}]", "eval.interval=0", "eval.n_samples=2",
             "checkpoint.interval=0", cwd=REPO, timeout=RUN_TIMEOUT)
    ok(p)
    metrics = read_metrics(tmp_path / "countdown" / "metrics.jsonl")
    steps = [r for r in metrics if "samples/generated" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in steps)
    # the extras are means over the samples scored since the previous step: a step may have had none (the
    # next step's samples can all be scored before this step's metrics are read), never every step
    scored = [r for r in steps if "reward/acc" in r]
    assert scored, steps
    for r in scored:
        for key in ("reward/acc", "reward/valid_expr", "reward/uses_numbers"):
            assert 0.0 <= r[key] <= 1.0, (key, r)
        assert r["reward/acc"] <= r["reward/valid_expr"]  # solved implies valid
    assert sum(r.get("reward/n", 0) for r in steps) >= steps[-1]["samples/consumed"]  # every trained one scored
    evals = [r for r in metrics if "eval/avg/pass@1" in r]
    assert evals and all(0.0 <= r["eval/avg/pass@1"] <= 100.0 for r in evals)


def test_the_weighted_terms_of_docs_tasks_md_validate_and_score(tmp_path):
    """docs/tasks.md's example of several terms, as written there: the recipe snippet validates on the Countdown
    recipe and the functions score by the contract."""
    from m2po_megatron.config import load_config
    from m2po_megatron.reward.compose import rewards_from_config
    from m2po_megatron.reward.types import RewardInput

    doc = (REPO / "docs" / "tasks.md").read_text()
    section = doc.split("## 2. Several weighted terms", 1)[1].split("\n## ", 1)[0]
    snippet, code = re.findall(r"```(?:yaml|python)\n(.*?)```", section, re.S)[:2]
    (tmp_path / "my_rewards.py").write_text(code)
    recipe = yaml.safe_load((COUNTDOWN / "recipe.yaml").read_text())
    recipe["extends"] = str(REPO / "recipes" / "tiny-cpu.yaml")
    recipe["reward"] = yaml.safe_load(snippet.replace("my_rewards.py", str(tmp_path / "my_rewards.py")))["reward"]
    (tmp_path / "terms.yaml").write_text(yaml.safe_dump(recipe))
    cfg = load_config(tmp_path / "terms.yaml", check_files=False)
    assert [t.name for t in cfg.reward.terms] == ["solve", "format", "length"]
    with rewards_from_config(cfg) as rewards:
        good, bad = rewards.score([RewardInput("5-1=4 4*7=28 \\boxed{28}", list(range(12)), dict(ROW)),
                                   RewardInput("\\boxed{1} \\boxed{2}", list(range(30)), dict(ROW))])
    assert good.score == pytest.approx(1.0 + 0.1 * 1 + 0.05 * (1 - 12 / 24))
    assert bad.score == pytest.approx(0.0)
    assert good.extras["solve/acc"] == 1.0 and good.extras["format/score"] == 1.0 and good.acc == 1.0
    assert bad.extras["format/score"] == 0.0 and bad.extras["length/score"] == 0.0


# ------------------------------------------------------------------------------------------------ code
def test_code_recipe_validates_without_files(tmp_path):
    """Off-cluster, as docs/tasks.md says; the weights are found through M2PO_MODELS_DIR as the paper recipes'."""
    p = m2po("config", str(CODE / "recipe.yaml"), "--no-check-files", cwd=REPO, M2PO_MODELS_DIR=str(tmp_path))
    ok(p)
    cfg = yaml.safe_load(p.stdout)
    assert cfg["reward"]["function"] == "code" and cfg["reward"]["args"] == {"tests_key": "tests"}
    assert cfg["data"]["label_key"] is None and cfg["data"]["prompt_template"] is None
    assert cfg["data"]["train_path"] == str(REPO / "examples/code/problems.jsonl") and cfg["run"]["name"] == "code"
    assert cfg["model"]["hf_path"] == f"{tmp_path}/Qwen3-4B-Base"


def _code_reward():
    """The recipe's reward as the trainer resolves it (the registered name `code`), with the recipe's args."""
    from m2po_megatron.config import load_config
    from m2po_megatron.reward.functions import load_reward_function, resolve_target

    cfg = load_config(CODE / "recipe.yaml", check_files=False)
    fn = load_reward_function(resolve_target(cfg.reward.function), "reward.function")
    return lambda response, row: fn(response, [], row, **dict(cfg.reward.args))


BROKEN = {  # a plausible wrong answer per problem style
    "code/sum-two": "```python\na, b = map(int, input().split())\nprint(a - b)\n```",
    "code/fizzbuzz": "```python\nn = int(input())\nfor i in range(1, n + 1):\n    print('Fizz' if i % 3 == 0 else i)\n```",
    "code/gcd": "```python\ndef gcd(a, b):\n    return min(a, b)\n```",
    "code/fib": "```python\ndef fib(n):\n    return n\n```",
}


@pytest.mark.timeout(300)
def test_code_references_pass_and_broken_solutions_fail():
    score = _code_reward()
    problems = rows(CODE / "problems.jsonl")
    assert 6 <= len(problems) <= 10 and any("fn_name" in p["tests"] for p in problems)
    for p in problems:
        assert score(p["solution"], p)["score"] == 1.0, p["id"]
    by_id = {p["id"]: p for p in problems}
    for pid, broken in BROKEN.items():
        out = score(broken, by_id[pid])
        assert (out["score"], out["wrong_answer"]) == (0.0, 1.0), (pid, out)  # run, and failed on its output
    out = score("print(8)", by_id["code/sum-two"])
    assert (out["score"], out["no_code"]) == (0.0, 1.0)  # no code block: nothing is run


# ------------------------------------------------------------------------------------------------ autobuild
def test_autobuild_builds_only_the_repositorys_own_missing_tiny_tasks(tmp_path, monkeypatch):
    repo, elsewhere = tmp_path / "repo", tmp_path / "elsewhere"
    cache = repo / ".cache"
    (repo / "examples").mkdir(parents=True)
    elsewhere.mkdir()
    decide = lambda path, cwd=repo: tiny_task_dir(path, cwd, repo)  # noqa: E731

    # missing, and named by any spelling of the repository's .cache/<known name>: built there
    assert decide(".cache/tiny-task") == cache.resolve() / "tiny-task"
    assert decide(".cache/tiny-task-moe", cwd=elsewhere) is None  # a relative path is the working directory's
    assert decide(str(cache / "tiny-agent-task"), cwd=elsewhere) == cache.resolve() / "tiny-agent-task"
    assert decide(str(repo / "examples" / ".." / ".cache" / "tiny-task-fair")) == cache.resolve() / "tiny-task-fair"
    monkeypatch.setenv("M2PO_TEST_REPO", str(repo))
    assert decide("$M2PO_TEST_REPO/.cache/tiny-task-toy", cwd=elsewhere) == cache.resolve() / "tiny-task-toy"
    (cache / "tiny-task").mkdir(parents=True)
    assert decide(".cache/tiny-task") == cache.resolve() / "tiny-task"  # an empty directory is still missing

    # left alone: there already (finished or not), not the repository's, not one of the project's own names
    (cache / "tiny-task" / INFO_FILE).write_text("{}")
    assert decide(".cache/tiny-task") is None
    (cache / "tiny-task-moe").mkdir()
    (cache / "tiny-task-moe" / "config.json").write_text("{}")  # a half-built or hand-made directory
    assert decide(".cache/tiny-task-moe") is None
    (elsewhere / ".cache" / "tiny-task-toy").mkdir(parents=True)
    assert decide(".cache/tiny-task-toy", cwd=elsewhere) is None  # the working directory's, which exists
    assert decide(str(elsewhere / ".cache" / "tiny-task-fair"), cwd=elsewhere) is None  # another .cache
    assert decide(str(cache / "my-model")) is None
    assert decide(str(cache / "sub" / "tiny-task")) is None
    assert decide(str(repo / "tiny-task")) is None
    assert decide("Qwen/Qwen3-4B-Base") is None
    assert decide(None) is None and decide("") is None
    said = []
    assert build_missing_tiny_task(str(cache / "my-model"), repo=repo, log=said.append) is None and not said


def test_autobuild_builds_as_the_documented_commands_do():
    """BUILDS holds the settings of `m2po demo` and of the Makefile's build lines, flag for flag."""
    from m2po_megatron.commands.demo import DEMO_TARGET_ACCURACY

    assert BUILDS["tiny-task"].kwargs == {"seed": 0, "target_accuracy": DEMO_TARGET_ACCURACY}
    make = (REPO / "Makefile").read_text().replace("\\\n", " ")
    found = {}
    for name, flags in re.findall(r"tools/build_tiny_model\.py \.cache/([\w-]+)((?:\s+--[\w-]+(?:\s+[\d.]+)?)*)", make):
        kwargs, moe, agent = {}, False, False
        for flag, value in re.findall(r"--([\w-]+)(?:\s+([\d.]+))?", flags):
            if flag in ("moe", "agent"):
                moe, agent = moe or flag == "moe", agent or flag == "agent"
                continue
            key = flag.replace("-", "_")
            kwargs[key] = True if not value else float(value) if "." in value else int(value)
        if agent and "target_accuracy" in kwargs:
            kwargs["target_success"] = kwargs.pop("target_accuracy")
        found[name] = TinyBuild(BUILDS[name].command if name in BUILDS else "", kwargs, agent=agent, moe=moe)
    assert set(found) == set(BUILDS) - {"tiny-task"}
    for name, build in found.items():
        assert (BUILDS[name].kwargs, BUILDS[name].agent, BUILDS[name].moe) == (build.kwargs, build.agent, build.moe)


@pytest.mark.timeout(300)
def test_a_build_lands_whole_and_never_replaces_another(tmp_path):
    """A real (cut-down) build: renamed into place with no temporary left; and when another run's build got
    there first, that one is kept untouched."""
    quick = TinyBuild("`test`", {"seed": 0, "target_accuracy": 0.5, "max_warmup_steps": 1, "check_every": 1,
                                 "n_train": 4, "n_eval": 4, "n_calibration": 4})
    target = tmp_path / ".cache" / "tiny-task"
    said = []
    assert build_tiny_task_at(target, quick, log=said.append) == target
    assert json.loads((target / INFO_FILE).read_text())["warmup_steps"] == 1
    assert (target / "config.json").is_file() and len(rows(target / "train.jsonl")) == 4
    assert sorted(p.name for p in target.parent.iterdir()) == ["tiny-task"] and not said

    other = tmp_path / ".cache" / "tiny-task-toy"
    other.mkdir()
    (other / INFO_FILE).write_text('{"theirs": true}')
    build_tiny_task_at(other, quick, log=said.append)
    assert (other / INFO_FILE).read_text() == '{"theirs": true}' and sorted(p.name for p in other.iterdir()) == [INFO_FILE]
    assert sorted(p.name for p in other.parent.iterdir()) == ["tiny-task", "tiny-task-toy"]
    assert len(said) == 1 and "another run" in said[0]


def test_train_leaves_a_missing_model_outside_the_repository_to_validation(tmp_path):
    """`m2po train` builds nothing for a path outside the repository's .cache/: validation names the path."""
    missing = tmp_path / ".cache" / "tiny-task"
    p = m2po("train", str(COUNTDOWN / "recipe.yaml"), f"model.hf_path={missing}", f"run.output_dir={tmp_path}",
             cwd=REPO, timeout=120)
    assert p.returncode != 0 and "building the tiny task" not in p.stdout
    assert str(missing) in p.stdout + p.stderr and not missing.exists()
