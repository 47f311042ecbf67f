"""The tiny task's problem splits: eval and calibration held out from everything, and with disjoint_train
the warm-up kept off the RL train problems; the option off leaves the build as it was."""

import json

import pytest

from m2po_megatron.demo.synthetic import SumSpec
from m2po_megatron.demo.tiny_model import (DEFAULT_SPEC, INFO_FILE, SPLITS, build_tiny_task, check_split_sizes,
                                           task_splits)
from tools.build_tiny_model import main as build_main

FAIR = dict(n_eval=256, n_calibration=128, n_train=256)  # the fair protocol's sizes


def _problems(splits):
    return {k: {r["problem"] for r in rows} for k, rows in splits.items()}


def _two_terms(rows):
    return sum(r["problem"].count("+") == 1 for r in rows) / len(rows)


@pytest.mark.parametrize("seed, uniform", [(0, False), (3, False), (0, True), (3, True)])
def test_disjoint_train_keeps_the_warmup_off_train(seed, uniform):
    splits = task_splits(seed, DEFAULT_SPEC, **FAIR, max_warmup=20000, disjoint_train=True, uniform_splits=uniform)
    p = _problems(splits)
    for i, a in enumerate(SPLITS):
        for b in SPLITS[i + 1:]:
            assert not p[a] & p[b], (a, b)
    # the warm-up gets every problem the other three leave: 1,100 - 256 - 128 - 256
    assert len(p["warmup"]) == len(splits["warmup"]) == DEFAULT_SPEC.space - sum(FAIR.values()) == 460
    assert [len(splits[k]) for k in ("eval", "calibration", "train")] == [256, 128, 256]
    assert all(len({r["id"] for r in rows}) == len(rows) for rows in splits.values())


@pytest.mark.parametrize("uniform", [False, True])
def test_without_the_option_only_the_warmup_changes(uniform):
    same = dict(seed=0, spec=DEFAULT_SPEC, **FAIR, max_warmup=20000, uniform_splits=uniform)
    off, on = task_splits(**same), task_splits(**same, disjoint_train=True)
    assert all(off[k] == on[k] for k in ("eval", "calibration", "train"))
    p = _problems(off)
    assert p["train"] <= p["warmup"]  # off, the warm-up draws from everything but eval and calibration
    for held in ("eval", "calibration"):
        assert not p[held] & (p["train"] | p["warmup"]) and not p["eval"] & p["calibration"]


def test_uniform_splits_share_the_spaces_mix_of_term_counts():
    """Drawn by make_problem, eval takes most of the 100 two-term sums and a disjoint warm-up none; cut from
    the shuffled space every split has about the space's 100 / 1,100."""
    drawn = task_splits(0, DEFAULT_SPEC, **FAIR, max_warmup=20000, disjoint_train=True)
    assert _two_terms(drawn["eval"]) > 0.25 and _two_terms(drawn["warmup"]) == 0
    cut = task_splits(0, DEFAULT_SPEC, **FAIR, max_warmup=20000, disjoint_train=True, uniform_splits=True)
    assert all(0.04 < _two_terms(rows) < 0.16 for rows in cut.values()), {k: _two_terms(v) for k, v in cut.items()}
    assert task_splits(0, DEFAULT_SPEC, **FAIR, max_warmup=100, uniform_splits=True)["warmup"] == \
        task_splits(0, DEFAULT_SPEC, **FAIR, max_warmup=20000, uniform_splits=True)["warmup"][:100]


@pytest.mark.parametrize("sizes, disjoint, words", [
    (dict(n_eval=256, n_calibration=128, n_train=800), True, ["--n-train", "at most 684", "--disjoint-train"]),
    (dict(n_eval=600, n_calibration=128, n_train=512), False, ["--n-train", "--n-eval", "1,100"]),
    (dict(n_eval=1000, n_calibration=128, n_train=1), True, ["--n-eval", "--n-calibration"]),
    (dict(n_eval=0, n_calibration=128, n_train=1), False, ["--n-eval"]),
])
def test_split_sizes_that_do_not_fit_are_refused(sizes, disjoint, words):
    with pytest.raises(ValueError) as e:
        check_split_sizes(DEFAULT_SPEC, **sizes, disjoint_train=disjoint, batch_size=32)
    assert all(w in str(e.value) for w in words), str(e.value)
    check_split_sizes(DEFAULT_SPEC, **FAIR, disjoint_train=disjoint, batch_size=32)  # the fair sizes fit


def _files(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name != INFO_FILE}


@pytest.mark.timeout(600)
def test_builds_with_and_without_the_option(tmp_path):
    """Tiny warm-ups (4 steps). The option off builds byte for byte what a build without it does; on, it
    changes the model (another warm-up) but not train/eval, and the CLI records it in build_info.json."""
    small = dict(seed=0, n_eval=32, n_calibration=32, n_train=64, max_warmup_steps=4, log=lambda *_: None)
    build_tiny_task(tmp_path / "omitted", **small)
    build_tiny_task(tmp_path / "off", **small, disjoint_train=False)
    assert _files(tmp_path / "omitted") == _files(tmp_path / "off")
    assert build_main([str(tmp_path / "on"), "--seed", "0", "--n-eval", "32", "--n-calibration", "32",
                       "--n-train", "64", "--max-warmup-steps", "4", "--disjoint-train"]) == 0
    off, on = _files(tmp_path / "off"), _files(tmp_path / "on")
    assert on["train.jsonl"] == off["train.jsonl"] and on["eval.jsonl"] == off["eval.jsonl"]
    assert on["model.safetensors"] != off["model.safetensors"]
    info = {k: json.loads((tmp_path / k / INFO_FILE).read_text()) for k in ("off", "on")}
    assert info["off"]["disjoint_train"] is False and info["on"]["disjoint_train"] is True
    assert info["on"]["n_calibration"] == 32 and info["on"]["n_warmup_problems"] == 4 * 32
    assert info["off"]["uniform_splits"] is False and info["on"]["check_every"] == 20


@pytest.mark.timeout(600)
def test_uniform_build_writes_its_splits(tmp_path):
    assert build_main([str(tmp_path), "--seed", "1", "--n-eval", "32", "--n-calibration", "32", "--n-train",
                       "64", "--max-warmup-steps", "4", "--disjoint-train", "--uniform-splits"]) == 0
    want = task_splits(1, DEFAULT_SPEC, 32, 32, 64, 4 * 32, disjoint_train=True, uniform_splits=True)
    for name, split in (("train.jsonl", "train"), ("eval.jsonl", "eval")):
        rows = [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
        assert [r["problem"] for r in rows] == [r["problem"] for r in want[split]]
    assert json.loads((tmp_path / INFO_FILE).read_text())["uniform_splits"] is True


def test_small_spec_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="--disjoint-train"):
        build_tiny_task(tmp_path / "t", spec=SumSpec(2, 2, 9), n_eval=32, n_calibration=32, n_train=30,
                        disjoint_train=True, log=lambda *_: None)
    assert not (tmp_path / "t").exists()


def test_the_builder_tool_refuses_a_bad_flag_with_exit_code_2(tmp_path, capsys):
    assert build_main([str(tmp_path / "t"), "--n-train", "800", "--n-eval", "256", "--disjoint-train"]) == 2
    assert "lower --n-train to at most" in capsys.readouterr().err and not (tmp_path / "t").exists()


def test_check_every_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="--check-every"):
        build_tiny_task(tmp_path / "t", check_every=0, log=lambda *_: None)
    assert not (tmp_path / "t").exists()
