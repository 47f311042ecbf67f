"""Small frictions (issue 48): megatron's known warnings, `m2po demo --help` against its recipe, a micro-batch
too small for one sequence, `m2po convert` pointed at a step directory, distinct colours in a plot panel,
eval set names, and the docs index."""
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from m2po_megatron.infra.known_warnings import KNOWN_LOG_LINES, KNOWN_WARNINGS

ROOT = Path(__file__).resolve().parents[1]

# One real trainer rank in a fresh interpreter (the filters must be there before megatron's first import, which
# this test process may have done long ago): a MegatronActor built and trained one step on a tiny Qwen2, every
# warning shown (-W always), then two look-alikes that must still show (the filters are not blanket).
_TRAINER = textwrap.dedent("""
    import sys, warnings
    sys.path.insert(0, {actor_tests!r})
    import torch
    from actor_workers import tiny_config
    from m2po_megatron.actor.actor import MegatronActor
    from m2po_megatron.actor.batch import TrainBatch

    cfg = tiny_config("qwen2_untied")
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, cfg["vocab_size"], (12,), generator=g) for _ in range(4)]
    batch = TrainBatch(ids, [4] * 4, behav_log_probs=[-torch.rand(8, generator=g) for _ in ids],
                       advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]))
    actor = MegatronActor(hf_config=cfg, micro_batch_tokens=24, lr=1e-4, loss_name="m2po")
    m = actor.train_step(batch)
    actor.close()
    print("TRAINED", m["num_seqs"], flush=True)
    print("CONTROLS", file=sys.stderr, flush=True)
    warnings.warn_explicit("Apex is not installed. Falling back to Torch Norm", UserWarning, "elsewhere.py", 1,
                           module="elsewhere")
    warnings.warn_explicit("a new megatron warning", UserWarning, "m.py", 1, module="megatron.core.optimizer")
""")


@pytest.mark.timeout(300)
def test_the_trainer_path_prints_none_of_megatrons_known_warnings(tmp_path):
    p = subprocess.run([sys.executable, "-W", "always", "-c", _TRAINER.format(actor_tests=str(ROOT / "tests/actor"))],
                       cwd=tmp_path, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "TRAINED 4" in p.stdout
    err, controls = p.stderr.split("CONTROLS\n")
    for _, message, _ in KNOWN_WARNINGS:
        assert not re.search(message, err), (message, err[-3000:])
    for _, start in KNOWN_LOG_LINES:
        assert start not in err, (start, err[-3000:])
    # the same message from another module, and another message from megatron, still show
    assert "elsewhere.py:1: UserWarning: Apex is not installed" in controls
    assert "a new megatron warning" in controls


# --- `m2po demo --help` ---------------------------------------------------------------------------------------
def _help_counts(text: str) -> tuple[int, int]:
    flat = " ".join(text.split())
    m = re.search(r"(\d+) Megatron ranks? \(TP (\d+), PP (\d+), DP (\d+)\) and (\d+) rollout servers?", flat)
    assert m, flat
    return int(m[1]), int(m[5])


def test_demo_help_states_the_recipes_ranks_and_servers(capsys):
    from m2po_megatron.cli import main
    from m2po_megatron.commands.demo import RECIPE
    from m2po_megatron.config import load_config

    with pytest.raises(SystemExit) as e:
        main(["demo", "--help"])
    assert e.value.code == 0
    cfg = load_config(RECIPE, check_files=False)
    p = cfg.parallel
    ranks = (p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
             * p.data_parallel_size)
    assert _help_counts(capsys.readouterr().out) == (ranks, cfg.rollout.num_servers)


def test_demo_help_follows_a_changed_recipe(tmp_path):
    from m2po_megatron.commands.demo import describe
    from m2po_megatron.config import RECIPES_DIR

    text = (RECIPES_DIR / "tiny-cpu.yaml").read_text()
    text = text.replace("  data_parallel_size: 1\n", "  data_parallel_size: 2\n").replace(
        "  num_servers: 1\n", "  num_servers: 3\n")
    (tmp_path / "r.yaml").write_text(text)
    assert _help_counts(describe(str(tmp_path / "r.yaml"))) == (2, 3)


# --- a micro-batch too small for one sequence -------------------------------------------------------------------
def test_micro_batch_below_the_longest_sequence_is_refused_with_exit_2(tmp_path, capsys):
    from m2po_megatron.cli import main
    from m2po_megatron.config import ConfigError, load_config

    cfg = load_config("tiny-cpu", check_files=False)
    longest = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    assert load_config("tiny-cpu", [f"train.micro_batch_tokens={longest}"], check_files=False)  # exactly fits
    with pytest.raises(ConfigError, match=rf"train.micro_batch_tokens = {longest - 1} is below the longest "
                                          rf"sequence.* = {longest}.*at least {longest}"):
        load_config("tiny-cpu", [f"train.micro_batch_tokens={longest - 1}"], check_files=False)
    assert main(["config", "tiny-cpu", "train.micro_batch_tokens=16"]) == 2
    assert "raise train.micro_batch_tokens to at least" in capsys.readouterr().err


# --- `m2po convert` pointed at a step directory ----------------------------------------------------------------
def test_convert_at_a_step_directory_hints_its_megatron_subdirectory(tmp_path, capsys):
    from m2po_megatron.cli import main

    ckpts = tmp_path / "checkpoints"
    for step in ("step_0000010", "step_0000040"):
        (ckpts / step / "megatron").mkdir(parents=True)
        (ckpts / step / "megatron" / "metadata.json").write_text("{}")
    out = str(tmp_path / "hf")
    assert main(["convert", "megatron-to-hf", "--ckpt", str(ckpts / "step_0000010"), "--out", out]) == 2
    err = capsys.readouterr().err
    assert f"did you mean {ckpts / 'step_0000010' / 'megatron'}?" in err, err
    assert main(["convert", "megatron-to-hf", "--ckpt", str(ckpts), "--out", out]) == 2
    assert f"did you mean {ckpts / 'step_0000040' / 'megatron'}?" in capsys.readouterr().err  # the latest
    assert main(["convert", "megatron-to-hf", "--ckpt", str(tmp_path / "hf-nothing"), "--out", out]) == 2
    assert "did you mean" not in capsys.readouterr().err


# --- plot colours -----------------------------------------------------------------------------------------------
def test_every_series_of_a_panel_has_its_own_colour_and_a_run_keeps_its_colour(tmp_path):
    import matplotlib.colors as mcolors
    import matplotlib.pyplot as plt

    from m2po_megatron.sweep.plot import runs_figure

    runs = []
    for r in range(3):
        d = tmp_path / f"run{r}"
        d.mkdir()
        rows = [{"step": s, "reward/mean": s + r, "staleness/mean": 1.0, "staleness/max": 2.0,
                 **{f"eval/set{k}/pass@1": k + s for k in range(5)}} for s in range(4)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
        runs.append(d)
    for dirs in (runs[:1], runs):
        fig = runs_figure(dirs, keys=["reward/mean", "staleness/*", "eval/*/pass@1"])
        try:
            first = {}  # run label -> the colours of its first series in each panel
            for ax, n_keys in zip(fig.axes, (1, 2, 5)):
                colours = [mcolors.to_hex(line.get_color()) for line in ax.get_lines()]
                assert len(colours) == len(set(colours)) == len(dirs) * n_keys, (ax.get_title(), colours)
                for line in ax.get_lines():
                    run, _, key = line.get_label().partition(": ")
                    if key in ("", "staleness/max", "eval/set0/pass@1"):  # sorted first in its panel
                        first.setdefault(run, set()).add(mcolors.to_hex(line.get_color()))
            assert all(len(c) == 1 for c in first.values()), first  # one colour per run across panels
            assert len({c.pop() for c in first.values()}) == len(dirs)
        finally:
            plt.close(fig)


# --- eval set names ---------------------------------------------------------------------------------------------
def test_eval_sets_named_by_file_or_by_directory_when_the_file_names_a_split(tmp_path):
    from m2po_megatron.eval.benchmarks import eval_set_names

    assert eval_set_names([".cache/tiny-task/eval.jsonl", "data/deepscaler/eval/math500.jsonl",
                           "x/aime24.jsonl.gz", "hub/gsm8k/test-00000-of-00001.parquet",
                           "data/countdown/eval/test.jsonl"]) == [
        "tiny-task", "math500", "aime24", "gsm8k", "countdown"]
    with pytest.raises(ValueError, match=r"data.eval_paths\[0\] \(a/math500.jsonl\) and data.eval_paths\[1\] "
                                         r"\(b/math500.jsonl\) are both named 'math500'"):
        eval_set_names(["a/math500.jsonl", "b/math500.jsonl"])


def test_a_run_names_its_eval_metrics_without_repeating_eval(tmp_path):
    """The run's eval sets (run/inputs.load_data, before Ray starts) carry those names; one name twice is refused."""
    from m2po_megatron.config import ConfigError, load_config
    from m2po_megatron.demo.tiny_tokenizer import build_tiny_tokenizer
    from m2po_megatron.run.inputs import load_data

    task = tmp_path / "tiny-task"
    task.mkdir()
    row = {"prompt": "1+1=", "answer": "2"}
    for name in ("train", "eval"):
        (task / f"{name}.jsonl").write_text(json.dumps(row) + "\n")
    over = [f"data.train_path={task / 'train.jsonl'}", f"model.hf_path={tmp_path / 'm'}"]
    cfg = load_config("tiny-cpu", [*over, f"data.eval_paths=[{task / 'eval.jsonl'}]"], check_files=False)
    _, sets = load_data(cfg, build_tiny_tokenizer())
    assert [s.name for s in sets] == ["tiny-task"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "tiny-task.jsonl").write_text(json.dumps(row) + "\n")
    both = f"data.eval_paths=[{task / 'eval.jsonl'},{tmp_path / 'other' / 'tiny-task.jsonl'}]"
    cfg = load_config("tiny-cpu", [*over, both], check_files=False)
    with pytest.raises(ConfigError, match="are both named 'tiny-task'"):
        load_data(cfg, build_tiny_tokenizer())


# --- the docs index ---------------------------------------------------------------------------------------------
def test_the_docs_index_lists_every_page_and_every_link_resolves():
    docs = ROOT / "docs"
    index = (docs / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", index)
    assert links, "no links read from docs/README.md"
    missing = [link for link in links if not (docs / link).is_file()]
    assert not missing, f"docs/README.md links to missing files: {missing}"
    pages = {str(p.relative_to(docs)) for p in docs.rglob("*.md")} - {"README.md"}
    unlisted = sorted(pages - set(links))
    assert not unlisted, f"add a line for each of {unlisted} to docs/README.md"
    assert len(links) == len(set(links)), "a page is listed twice"
    assert "docs/README.md" in (ROOT / "README.md").read_text()  # the README points to the index
