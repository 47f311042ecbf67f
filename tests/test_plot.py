"""m2po plot: PNGs from synthetic metrics.jsonl files, overlaid runs, truncated lines, clear errors."""
import json
import math

import matplotlib.image as mpimg
import pytest

from m2po_megatron.cli import main
from m2po_megatron.sweep.plot import plot_runs, read_metrics_file


def _write_run(run_dir, steps=40, seed=0.0, eval_every=10, truncate=False):
    run_dir.mkdir(parents=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for s in range(steps):
            row = {"step": s, "reward/mean": 0.2 + 0.5 * (1 - math.exp(-s / 15)) + seed,
                   "staleness/mean": min(s, 8) * 0.9, "staleness/max": min(s, 8), "loss": "nan"}
            if s % eval_every == 0:
                row.update({"eval/avg": 0.3 + s / 200 + seed, "eval/aime24/pass@1": 0.1 + s / 400,
                            "eval/math500/pass@1": 0.5 + s / 100})
            f.write(json.dumps(row) + "\n")
        if truncate:
            f.write('{"step": 40, "reward/me')
    return run_dir


def _png(path):
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(path)
    assert img.std() > 0.01  # not a blank canvas
    return img


def test_default_panels_and_overlay(tmp_path):
    a = _write_run(tmp_path / "m2po-s256")
    b = _write_run(tmp_path / "grpo-s256", seed=-0.1)
    out = plot_runs([a, b], tmp_path / "out" / "cmp.png")
    assert out == tmp_path / "out" / "cmp.png" and out.stat().st_size > 20_000
    img = _png(out)
    assert img.shape[0] == 960  # three panels (reward, accuracy, staleness) x 320 px


def test_panels_without_data_are_skipped(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": s / 10}) + "\n"
                                               for s in range(5)))
    img = _png(plot_runs([run], tmp_path / "p.png"))
    assert img.shape[0] == 320  # reward only


def test_three_policy_panels_appear_only_when_logged(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    rows = [{"step": s, "reward/mean": s / 10, "rollout_corr/kl_k1": 1e-3, "rollout_corr/kl_k3": 1e-3,
             "rollout_corr/masked_frac": 0.01, "ratio_parts/drift_m2": s * 1e-4, "ratio_parts/mismatch_m2": 2e-3,
             "ratio_parts/total_m2": 2e-3 + s * 1e-4} for s in range(5)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    img = _png(plot_runs([run], tmp_path / "p.png"))
    assert img.shape[0] == 4 * 320  # reward, the KL, the masked fraction and the three second moments


def test_keys_and_globs(tmp_path):
    run = _write_run(tmp_path / "r")
    img = _png(plot_runs([run], tmp_path / "k.png", keys=["eval/*/pass@1", "staleness/max"]))
    assert img.shape[0] == 640
    with pytest.raises(ValueError, match=r"'nope/\*' matches no metric .* available: eval/aime24/pass@1"):
        plot_runs([run], tmp_path / "x.png", keys=["nope/*"])


def test_missing_metrics_file_names_the_path(tmp_path):
    good = _write_run(tmp_path / "good")
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "absent" / "metrics.jsonl")):
        plot_runs([good, tmp_path / "absent"], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_truncated_last_line_warns_and_resumed_steps_take_the_last_value(tmp_path):
    run = _write_run(tmp_path / "r", steps=5, truncate=True)
    with open(run / "metrics.jsonl") as f:
        text = f.read()
    # a resumed run re-logs step 3 after the truncated line was cut by the restart
    (run / "metrics.jsonl").write_text(text.rsplit("\n", 1)[0] + "\n" + json.dumps({"step": 3, "reward/mean": 9.0})
                                       + "\n" + '{"step": 4, "rew')
    with pytest.warns(UserWarning, match=r"metrics.jsonl:7: ignoring a truncated last line"):
        series = read_metrics_file(run / "metrics.jsonl")
    assert series["reward/mean"][3] == 9.0 and len(series["reward/mean"]) == 5
    assert math.isnan(series["loss"][0])
    with pytest.warns(UserWarning):
        _png(plot_runs([run], tmp_path / "t.png"))


def test_corrupt_middle_line_is_an_error(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0, "reward/mean": 1}\n{"step": 1, "rew\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: bad metrics line"):
        read_metrics_file(run / "metrics.jsonl")
    (run / "metrics.jsonl").write_text('{"reward/mean": 1}\n{"step": 1}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:1: .*'step'"):
        read_metrics_file(run / "metrics.jsonl")


def test_cli(tmp_path, capsys, monkeypatch):
    run = _write_run(tmp_path / "run1")
    assert main(["plot", str(run)]) == 0
    assert capsys.readouterr().out.strip() == str(run / "metrics.png")
    _png(run / "metrics.png")
    monkeypatch.chdir(tmp_path)
    run2 = _write_run(tmp_path / "run2")
    assert main(["plot", str(run), str(run2), "--keys", "reward/mean"]) == 0
    assert _png(tmp_path / "runs.png").shape[0] == 320
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert "missing/metrics.jsonl: no metrics file" in capsys.readouterr().err
