"""The reference model (algo.use_kl_loss) under `m2po rehearse`: its host tensors leave the allocator model, their
copies in its pass are "reference" blocks, and its pass's traced peak stands beside the estimate's reference-pass
phase (infra/fake_world.py, rehearse/stage.py, rehearse/plan.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from m2po_megatron.infra.fake_world import RehearsalMode

REPO = Path(__file__).resolve().parents[2]
MiB = 2**20


def test_untracked_host_tensors_leave_the_model_and_their_copies_are_tagged():
    mode = RehearsalMode()
    with mode:
        mode.phase = "build"
        w = torch.empty(MiB, dtype=torch.float32)  # 4 MiB on the device
        host = torch.empty(2 * MiB, dtype=torch.float32)  # 8 MiB that a GPU run keeps on the host
    assert mode.live_bytes() == 12 * MiB
    assert mode.untrack([host], copies_kind="reference") == 8 * MiB
    assert mode.live_bytes() == 4 * MiB and mode.peak == 12 * MiB  # the peak stays until reset
    mode.reset_peak()
    assert mode.peak == 4 * MiB
    mode.phase = "temporaries"
    with mode, mode.peak_within() as inner:
        dev = host.to("cpu", copy=True)  # the pass's copy: a new storage, a "reference" block
        y = dev * 2  # anything else made meanwhile keeps the phase's kind
        host.add_(1)  # an in-place op on the host tensor allocates nothing
        del y
    assert inner["peak_bytes"] == 20 * MiB
    assert inner["at_peak"] == {"build": 4 * MiB, "reference": 8 * MiB, "temporaries": 8 * MiB}
    assert mode.peak == 20 * MiB  # the larger of before and within
    del dev
    assert mode.live_bytes() == 4 * MiB and w.numel() == MiB  # w: the device block alive throughout


@pytest.mark.timeout(300)
def test_a_recipe_with_the_reference_rehearses_within_the_estimate(tmp_path):
    """Qwen3-1.7B's recipe with 2 of its 28 layers at TP2 x DP4 with sequence parallelism, its reference offloaded:
    the step's peak (training) does not hold the reference, its pass does, both within 10 % of the estimate."""
    cfg = json.loads((REPO / "m2po_megatron/assets/configs/Qwen__Qwen3-1.7B-Base/config.json").read_text())
    cfg["num_hidden_layers"] = 2
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"extends: {REPO / 'recipes/paper/qwen3-1.7b-base.yaml'}\nmodel:\n  hf_config: {tmp_path}\n")
    p = subprocess.run([sys.executable, "-m", "m2po_megatron.cli", "rehearse", str(recipe), "algo.use_kl_loss=true",
                        "--max-microbatches", "1", "--format", "json"], cwd=REPO, capture_output=True, text=True,
                       timeout=280)
    rep = json.loads(p.stdout)
    assert p.returncode == 0, rep.get("problems")
    (s,) = rep["stages"]
    r = s["reference"]
    assert r["offload"] and abs(s["error_pct"]) <= 10 and abs(r["pass_error_pct"]) <= 10, r
    assert "reference" not in s["at_peak_gib"]  # on the host while training
    # in its pass: the whole reference copied in, beside the actor's weights, gradients and optimizer states
    kinds = r["pass_at_peak_gib"]
    assert kinds["reference"] == pytest.approx(r["weights_gib"], rel=1e-3) == pytest.approx(kinds["weights"], rel=1e-3)
    assert kinds["grads"] > 0 and kinds["optimizer"] > 0 and kinds["temporaries"] > 0
    assert r["estimate_training_gib"] > r["estimate_pass_gib"]
