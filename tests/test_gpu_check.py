"""benchmarks/gpu_check.py on CPU: the whole script in its --dry-run mode (toy sizes) where ray, omegaconf and
math-verify cannot be imported, the offline wheel install, and the per-part guard."""
import json
import os
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check  # noqa: E402

BLOCKED = ("ray", "omegaconf", "math_verify", "wandb")


def _blocker(tmp_path) -> Path:
    """A directory that shadows packages the GPU image lacks: importing them fails in every process."""
    d = tmp_path / "blocked"
    for name in BLOCKED:
        (d / name).mkdir(parents=True)
        (d / name / "__init__.py").write_text(f"raise ImportError('{name} is not installed on the GPU image')\n")
    return d


@pytest.mark.timeout(420)
def test_dry_run_without_ray_prints_one_json_summary(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(_blocker(tmp_path)), str(REPO)]))
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--budget-s", "380",
                           "--out", str(tmp_path / "s.json")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stdout[-2000:]  # one JSON summary; the logs went to stderr
    s = json.loads(lines[0])
    assert s == json.loads((tmp_path / "s.json").read_text())
    parts = s["parts"]
    assert parts["env"]["megatron_core"] and parts["env"]["cuda"] is False
    gt = parts["gpu_tests"]
    assert gt["returncode"] == 0 and gt["collected"] >= 4, gt  # the gpu tests import without ray
    actor, hf = parts["qwen3_1p7b"], parts["hf_1p7b"]
    assert "error" not in actor and "error" not in hf, (actor, hf)
    assert actor["finite"] and actor["tokens_per_s"] > 0 and actor["attention_backend"] == "sdpa"
    assert actor["parity"]["actor_max_abs"] <= 1e-4 < actor["parity"]["hf_bf16_max_abs"]
    assert actor["estimate_gib"]["total"] > 0 and hf["tokens"] == actor["tokens"] and hf["tokens_per_s"] > 0
    assert s["actor_over_hf_tokens_per_s"]["qwen3_1p7b"] == pytest.approx(
        actor["tokens_per_s"] / hf["tokens_per_s"], rel=1e-2)
    assert [r["n"] for r in parts["m2po_mask"]["rows"]] == [10**4, 10**5]


def _probe_wheel(d: Path) -> Path:
    """A minimal pure-python wheel, written by hand (no network, no build backend)."""
    d.mkdir(parents=True, exist_ok=True)
    whl = d / "m2po_wheel_probe-1.0-py3-none-any.whl"
    info = "m2po_wheel_probe-1.0.dist-info"
    files = {"m2po_wheel_probe/__init__.py": "VALUE = 42\n",
             f"{info}/METADATA": "Metadata-Version: 2.1\nName: m2po-wheel-probe\nVersion: 1.0\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{n},,\n" for n in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(whl, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return whl


@pytest.mark.timeout(180)
def test_missing_package_is_installed_offline_from_the_wheel_folder(tmp_path):
    whl = _probe_wheel(tmp_path / "wheels")
    code = (f"import sys, json; sys.path.insert(0, {str(REPO / 'benchmarks')!r}); import gpu_check as g; "
            f"r = g.ensure_wheels({{'m2po_wheel_probe': 'm2po-wheel-probe'}}, g.Path({str(whl.parent)!r}), "
            f"g.Path({str(tmp_path / 'site')!r})); import m2po_wheel_probe as m; "
            f"again = g.ensure_wheels({{'m2po_wheel_probe': 'm2po-wheel-probe'}}, g.Path({str(whl.parent)!r})); "
            f"print(json.dumps([r, m.VALUE, m.__file__, again]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=160, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    r, value, where, again = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["installed"] == [whl.name] and value == 42 and where.startswith(str(tmp_path / "site"))
    assert again["installed"] == []  # importable now: nothing is installed twice


def test_missing_wheel_names_the_download_command(tmp_path):
    with pytest.raises(RuntimeError, match=r"pip download .* -d \.whl m2po-wheel-probe==VERSION"):
        gpu_check.ensure_wheels({"m2po_wheel_probe": "m2po-wheel-probe"}, tmp_path / "none", tmp_path / "site")
    assert gpu_check.locked_version("megatron-core") == gpu_check.locked_version("megatron_core") is not None


def _boom():
    raise ValueError("boom in a part")


def _hang():
    threading.Event().wait()


def _numbers():
    return {"tokens_per_s": 5.0}


@pytest.mark.timeout(300)
def test_a_failing_or_overrunning_part_costs_only_its_own_numbers():
    assert "boom in a part" in gpu_check.run_part("boom", _boom, (), 120)["error"]
    assert "timed out after 5 s" in gpu_check.run_part("hang", _hang, (), 5)["error"]
    ok = gpu_check.run_part("ok", _numbers, (), 120)
    assert ok["tokens_per_s"] == 5.0 and ok["wall_s"] >= 0
    parts = {"qwen3_1p7b": {"tokens_per_s": 30.0}, "hf_1p7b": {"tokens_per_s": 20.0},
             "qwen3_4b": {"error": "x"}, "hf_4b": {"tokens_per_s": 1.0}}
    assert gpu_check.summarize(parts) == {"qwen3_1p7b": 1.5}
