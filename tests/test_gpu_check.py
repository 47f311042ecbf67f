"""benchmarks/gpu_check.py on CPU: the plan's budgets (--dry-run), the whole script in its --smoke mode (toy
sizes) where ray, omegaconf and math-verify cannot be imported, the offline wheel install, the per-part guard
(a part past its budget is killed with everything it spawned), the rollout-like rows and the goals."""
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
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


@pytest.mark.timeout(800)
def test_smoke_run_without_ray_prints_one_json_summary(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(_blocker(tmp_path)), str(REPO)]))
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--smoke", "--out", str(tmp_path / "s.json"),
                           "--profile", str(tmp_path / "profile")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=780)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stdout[-2000:]  # one JSON summary; the logs went to stderr
    s = json.loads(lines[0])
    assert s == json.loads((tmp_path / "s.json").read_text())
    parts = s["parts"]
    assert parts["env"]["megatron_core"] and parts["env"]["cuda"] is False
    gt = parts["gpu_tests"]
    assert gt["returncode"] == 0 and gt["collected"] >= 8, gt  # the gpu tests import without ray
    # they run last, with what the parts before them left of the total (more than their own 120 s here)
    assert s["plan"][-1]["name"] == "gpu_tests" and gt["budget_s"] > 120, (s["plan"], gt["budget_s"])
    assert parts["qwen3_4b"]["budget_s"] == 140  # the others get their own budgets (120 + 20 s to profile)
    for a, h in (("qwen3_1p7b", "hf_1p7b"), ("qwen3_4b", "hf_4b")):
        actor, hf = parts[a], parts[h]
        assert "error" not in actor and "error" not in hf, (actor, hf)
        assert actor["finite"] and actor["tokens_per_s"] > 0 and actor["attention_backend"] == "sdpa"
        assert actor["microbatches"] == 2 and hf["tokens"] == actor["tokens"] and hf["tokens_per_s"] > 0
        assert actor["estimate_gib"]["total"] > 0 and hf["padded_tokens"] >= hf["tokens"]
        assert actor["syncs"]["count"] is None and "no CUDA" in actor["syncs"]["why"]  # counted on GPU only
        assert s["actor_over_hf_tokens_per_s"][a] == pytest.approx(actor["tokens_per_s"] / hf["tokens_per_s"],
                                                                   rel=1e-2)
        # model FLOPs on the same real tokens for both (padding is no model work); no MFU without a GPU's peak
        assert actor["model_flops"] == hf["model_flops"] > 0 and actor["mfu"] is hf["mfu"] is None
        assert actor["achieved_tflops"] > 0 and actor["logprob_pass"] is hf["logprob_pass"] is True
        for name in (a, h):  # one profiled step each: the table, its trace
            prof = parts[name]["profile"]
            assert prof["categories"]["matmul"]["ms"] > 0 and prof["categories"]["optimizer"]["ms"] > 0, prof
            assert prof["categories"]["log_probs"]["ms"] > 0 and Path(prof["trace"]).is_file(), prof
        assert "forward_backward" in actor["profile"]["step_timers_s"]
    assert parts["qwen3_4b"]["recompute"] == parts["hf_4b"]["recompute"] == "full"
    par = parts["qwen3_1p7b"]["parity"]
    assert par["actor_max_abs"] <= 1e-4 < par["hf_bf16_max_abs"]
    assert [r["n"] for r in parts["m2po_mask"]["rows"]] == [10**4, 10**5]
    warm = parts["warmup"]["parts"]  # the actor parts' calls on their rows before the parts, then one more step
    assert [(w["row_tokens"], w["recompute"]) for w in warm] == [(1024, None), (1024, "full")], warm
    assert all(w["first_step_s"] > 0 < w["second_step_s"] for w in warm) and warm[0]["parity_log_probs_s"] > 0
    assert all(parts[n]["first_step_s"] > 0 for n in ("qwen3_1p7b", "hf_1p7b", "qwen3_4b", "hf_4b"))
    assert s["complete"] is True and "running" not in s
    goals = s["goals"]["goals"]
    assert goals["logprob_parity_vs_hf_bf16"]["pass"] is True  # fp32 on CPU: far inside the bound
    for name in ("peak_vs_estimate_qwen3_1p7b", "resume", "gradient_parity_vs_hf_bf16",
                 "host_syncs_independent_of_microbatches"):
        assert goals[name]["pass"] is None, goals[name]  # unmeasured without a GPU
    assert s["goals"]["all_pass"] is None and "resume" in s["goals"]["unmeasured"]
    assert goals["issue51_mfu_qwen3_1p7b"]["pass"] is None and s["peak"]["bf16_tflops"] is None
    assert "MFU" in proc.stderr and "profile (CPU self time" in proc.stderr


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


def test_a_wheel_folder_too_big_to_carry_is_refused(tmp_path):
    from gpu_parts.wheels import WHEEL_DIR_LIMIT_MIB, wheel_dir_problem

    d = tmp_path / "whl"
    d.mkdir()
    with open(d / "small.whl", "wb") as f:
        f.truncate(3 * 2**20)
    assert wheel_dir_problem(d) is None and wheel_dir_problem(tmp_path / "none") is None
    with open(d / "torch-2.11.0.whl", "wb") as f:  # sparse: no disk used
        f.truncate(int(WHEEL_DIR_LIMIT_MIB * 2**20))
    why = wheel_dir_problem(d)
    assert why and f"holds {WHEEL_DIR_LIMIT_MIB + 3:.1f} MiB" in why and "torch-2.11.0.whl" in why, why
    assert wheel_dir_problem(gpu_check.WHEEL_DIR) is None  # the checkout's own .whl/ (when filled) travels


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


_STUBBORN_CHILD = ("import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                   "open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid())); "
                   "os.replace(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(3600)")


def _stubborn_part(pid_file):
    """A part that starts a child which ignores SIGTERM, waits until the child has written its pid, then hangs
    (as a part whose torchrun rank or compile worker outlives it would)."""
    subprocess.Popen([sys.executable, "-c", _STUBBORN_CHILD, pid_file])
    while not os.path.exists(pid_file):
        time.sleep(0.05)
    threading.Event().wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie waiting for its reaper is dead too
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(300)
def test_a_failing_or_overrunning_part_costs_only_its_own_numbers():
    assert "boom in a part" in gpu_check.run_part("boom", _boom, (), 120)["error"]
    assert "ran past its budget of 5 s" in gpu_check.run_part("hang", _hang, (), 5)["error"]
    ok = gpu_check.run_part("ok", _numbers, (), 120)
    assert ok["tokens_per_s"] == 5.0 and ok["wall_s"] >= 0
    parts = {"qwen3_1p7b": {"tokens_per_s": 30.0}, "hf_1p7b": {"tokens_per_s": 20.0},
             "qwen3_4b": {"error": "x"}, "hf_4b": {"tokens_per_s": 1.0}}
    assert gpu_check.summarize(parts) == {"qwen3_1p7b": 1.5}


@pytest.mark.timeout(300)
def test_a_part_past_its_budget_is_killed_with_the_children_it_spawned(tmp_path):
    """The part's child ignores SIGTERM; the part's whole process group is killed, so nothing is left. The
    part here is a bare python (run_part's start_group and wait_group, without the torch import of
    runner._child that the other tests cover): its budget starts once the child is up, so the test does not
    wait out a budget sized for a loaded machine's start-up."""
    from gpu_parts.runner import start_group, wait_group

    pid_file = tmp_path / "child.pid"
    part = ("import subprocess, sys, threading; subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]]); "
            "threading.Event().wait()")
    proc = start_group([sys.executable, "-c", part, _STUBBORN_CHILD, str(pid_file)])
    deadline = time.monotonic() + 120
    while not pid_file.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert pid_file.exists(), "the part's child never started: the test proved nothing"
    assert wait_group(proc, 0.5) is True  # past its budget: SIGTERM to the group, SIGKILL after the grace
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 30  # generous: SIGKILL is immediate, reaping by init may lag a little
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), f"process {pid}, spawned by the part, survived it"


@pytest.mark.timeout(300)
def test_stopping_gpu_check_kills_the_running_part_and_its_children(tmp_path):
    """tools/gpu_check.sh's hard stop (SIGTERM to gpu_check) must not leave a part running in its own session."""
    pid_file = tmp_path / "child.pid"
    code = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import gpu_check, test_gpu_check as t; "
            "gpu_check.stop_parts_on_signals(); gpu_check.run_part('stubborn', t._stubborn_part, (sys.argv[3],), 250)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    main = subprocess.Popen([sys.executable, "-c", code, str(REPO / "benchmarks"), str(Path(__file__).parent),
                             str(pid_file)], env=env)
    deadline = time.monotonic() + 200
    while not pid_file.exists() and time.monotonic() < deadline and main.poll() is None:
        time.sleep(0.1)
    assert pid_file.exists(), "the part's child never started"
    main.terminate()
    assert main.wait(timeout=60) != 0
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), f"process {pid} of the part survived gpu_check's stop"


# --------------------------------------------------------------------------------------------- the plan
def test_dry_run_prints_the_plan_and_fails_when_the_budgets_do_not_fit():
    def run(*a):
        return subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--dry-run", *a], cwd=REPO,
                              capture_output=True, text=True, timeout=120)

    ok = run()
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "qwen3_4b" in ok.stdout and "te_fp8" in ok.stdout and "DOES NOT FIT" not in ok.stdout
    short = run("--budget-s", "300")
    assert short.returncode == 2 and "exceed the total of 300 s" in short.stdout, short.stdout
    assert run("--budget-s", "300", "--parts", "qwen3_1p7b,hf_1p7b").returncode == 0
    rerun = run("--budget-s", "240", "--parts", "qwen3_4b,hf_4b", "--part-budget", "qwen3_4b=150")
    assert rerun.returncode == 0 and re.search(r"qwen3_4b +150 s", rerun.stdout), rerun.stdout
    assert run("--budget-s", "240", "--parts", "qwen3_4b,hf_4b", "--part-budget", "qwen3_4b=190").returncode == 2
    assert run("--part-budget", "nosuch=3").returncode == 2
    long = run("--budget-s", "590")
    assert long.returncode == 2 and "does not fit one 600-s device command" in long.stdout, long.stdout
    prof = run("--profile", "/nonexistent/profile")  # the profile run: the dense parts' budgets grow, gpu_tests' shrink
    assert prof.returncode == 0 and prof.stdout.count("1 profiled step") == 8, prof.stdout
    assert re.search(r"gpu_tests +145 s\+", prof.stdout), prof.stdout


def test_the_warm_up_compiles_on_the_actor_parts_own_rows():
    """The warm-up's calls are the actor parts' (same model, rows, recompute, parity pass): the parts' graphs
    are the ones in the cache (gpu_parts/warmup.py)."""
    from gpu_parts.actor_part import actor_part
    from gpu_parts.warmup import ACTOR_ARGS

    for smoke in (False, True):
        parts = {p.name: p for p in gpu_check.plan(smoke, te=False)}
        specs = [{k: v for k, v in s.items() if k in ACTOR_ARGS} for s in parts["warmup"].fn.args[0]]
        actors = [{k: v for k, v in p.fn.keywords.items() if k in ACTOR_ARGS} for p in parts.values()
                  if isinstance(p.fn, functools.partial) and p.fn.func is actor_part]
        assert specs == actors and len(actors) == 2, (specs, actors)
        names = list(parts)
        assert names.index("warmup") < min(names.index("qwen3_1p7b"), names.index("qwen3_4b"))


def test_every_gpu_plan_fits_the_default_total_and_one_device_command():
    for te, profile in ((False, None), (True, None), (False, "p"), (True, "p")):
        parts = gpu_check.plan(False, te, profile_dir=profile)
        assert gpu_check.check_fit(parts, gpu_check.DEFAULT_TOTAL_S) == [], te
        profiled = {p.name for p in parts if isinstance(p.fn, functools.partial) and p.fn.keywords.get("profile_dir")}
        assert profiled == (set(gpu_check.PROFILED) if profile else set())
        assert {"gpu_tests", "qwen3_1p7b", "hf_1p7b", "qwen3_4b", "hf_4b", "m2po_mask"} <= {p.name for p in parts}
    assert gpu_check.DEFAULT_TOTAL_S + gpu_check.HARD_STOP_MARGIN_S < gpu_check.COMMAND_LIMIT_S
    sh = (REPO / "tools" / "gpu_check.sh").read_text()
    assert f"budget={gpu_check.DEFAULT_TOTAL_S:.0f}" in sh and f"margin={gpu_check.HARD_STOP_MARGIN_S:.0f}" in sh


# ---------------------------------------------------------------------------------------------- the rows
def test_recipe_rows_are_full_rows_of_rollout_like_sequences():
    from gpu_parts import rows as R
    from m2po_megatron.actor.packing import plan_microbatches

    lens = R.fill_rows(3, 16384, seed=0)
    assert lens == R.fill_rows(3, 16384, seed=0) != R.fill_rows(3, 16384, seed=1)  # seeded
    per_row = R.row_lengths(lens, 16384)
    assert len(per_row) == 3 and all(0.9 * 16384 <= n <= 16384 for n in per_row), per_row
    assert all(200 <= r <= 4000 and 32 <= p <= 400 for p, r in lens)
    batch = R.make_batch(lens, vocab=1000)
    mbs = plan_microbatches(batch, list(range(len(batch))), 16384)  # the actor's packer: the same rows
    assert sorted(m.seq_len for m in mbs) == sorted(per_row)
    assert [b.numel() for b in batch.behav_log_probs] == batch.response_lens
    many = R.draw_lengths(4000, seed=2)
    assert statistics.mean(p for p, _ in many) == pytest.approx(150, abs=5)
    resp = sorted(r for _, r in many)
    assert resp[0] >= 200 and resp[-1] <= 4000 and 700 < statistics.median(resp) < 1100  # log-uniform: ~894
    ragged = R.fill_rows(2, 16384, seed=0, ragged_multiple=16)
    assert all(n % 16 for n in R.row_lengths(ragged, 16384))
    toy = R.fill_rows(2, 1024, seed=0, scale=1024 / R.RECIPE_ROW)
    assert len(R.row_lengths(toy, 1024)) == 2 and len(toy) > 6  # the smoke mode's rows hold several sequences


def test_goals_pass_fail_and_unmeasured():
    from gpu_parts import goals as G

    T = "tests.actor.test_actor_gpu"
    parts = {"qwen3_1p7b": {"tokens_per_s": 30.0, "peak_over_estimate": 1.1,
                            "parity": {"actor_mean_abs": 0.02, "hf_bf16_mean_abs": 0.02},
                            "syncs": {"count": 40, "microbatches": 3}, "syncs_one_microbatch": {"count": 12}},
             "hf_1p7b": {"tokens_per_s": 20.0}, "qwen3_4b": {"tokens_per_s": 10.0, "peak_over_estimate": 1.3},
             "hf_4b": {"tokens_per_s": 10.0},
             "gpu_tests": {"tests": {f"{T}::test_resume_next_step_equals_an_uninterrupted_run[sdpa]": "passed",
                                     f"{T}::test_resume_next_step_equals_an_uninterrupted_run[te]": "skipped",
                                     f"{T}::test_gradients_no_worse_than_hf_bf16[sdpa]": "failed"}}}
    j = G.judge(parts)
    g = j["goals"]
    assert g["tokens_per_s_vs_hf_qwen3_1p7b"]["pass"] is True and g["tokens_per_s_vs_hf_qwen3_4b"]["pass"] is False
    assert g["peak_vs_estimate_qwen3_1p7b"]["pass"] is True and g["peak_vs_estimate_qwen3_4b"]["pass"] is False
    assert g["resume"]["pass"] is True and g["gradient_parity_vs_hf_bf16"]["pass"] is False
    assert g["logprob_parity_vs_hf_bf16"]["pass"] is True
    assert g["host_syncs_independent_of_microbatches"]["pass"] is False  # 40 syncs at 3 micro-batches, 12 at 1
    assert g["peak_memory_test_recipe_rows"]["pass"] is None and j["all_pass"] is None
    assert "tokens_per_s_vs_hf_qwen3_4b" in j["failed"] and "peak_memory_test_recipe_rows" in j["unmeasured"]


def test_gpu_test_results_survive_a_killed_pytest():
    """Without JUnit XML (pytest killed at the budget) the results come from pytest -v's lines, under the same
    names, so the goals still see the tests that finished."""
    from gpu_parts import goals as G
    from gpu_parts.misc import verbose_results

    log = ("tests/actor/test_actor_gpu.py::test_resume_next_step_equals_an_uninterrupted_run[sdpa] PASSED [ 10%]\n"
           "tests/actor/test_actor_gpu.py::test_gradients_no_worse_than_hf_bf16[sdpa] ERROR [ 20%]\n"
           "tests/actor/test_actor_gpu.py::test_peak_memory_within_the_estimate_at_the_recipe_rows[te-None] "
           "SKIPPED (no TE) [ 30%]\n")
    r = verbose_results(log)
    assert r == {"tests.actor.test_actor_gpu::test_resume_next_step_equals_an_uninterrupted_run[sdpa]": "passed",
                 "tests.actor.test_actor_gpu::test_gradients_no_worse_than_hf_bf16[sdpa]": "failed",
                 "tests.actor.test_actor_gpu::test_peak_memory_within_the_estimate_at_the_recipe_rows[te-None]":
                 "skipped"}
    g = G.judge({"gpu_tests": {"tests": r}})["goals"]
    assert g["resume"]["pass"] is True and g["gradient_parity_vs_hf_bf16"]["pass"] is False
    assert g["peak_memory_test_recipe_rows"]["pass"] is None


@pytest.mark.timeout(400)
def test_a_stopped_check_keeps_the_finished_parts_numbers(tmp_path):
    """The summary file is rewritten after every part: gpu_check stopped during a part (the shell's hard stop, a
    device command's limit) still leaves the parts that finished before it."""
    out = tmp_path / "s.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(_blocker(tmp_path)), str(REPO)]))
    # hf_1p7b finishes, qwen3_4b runs past a 1-s budget and is killed, then the check is stopped in hf_4b
    proc = subprocess.Popen([sys.executable, "benchmarks/gpu_check.py", "--smoke", "--parts",
                             "hf_1p7b,qwen3_4b,hf_4b", "--part-budget", "qwen3_4b=1", "--out", str(out)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 300
        s: dict = {}
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists():
                s = json.loads(out.read_text())  # never half-written: replaced atomically
                if s.get("running") == "hf_4b":
                    break
            time.sleep(0.2)
        assert s.get("running") == "hf_4b", s
        proc.terminate()  # during hf_4b: its numbers are lost, hf_1p7b's are not
        proc.wait(timeout=60)
    finally:
        proc.kill()
    s = json.loads(out.read_text())
    assert s["complete"] is False and s["running"] == "hf_4b"
    assert s["parts"]["hf_1p7b"]["tokens_per_s"] > 0 and "hf_4b" not in s["parts"]
    assert "ran past its budget of 1 s" in s["parts"]["qwen3_4b"]["error"], s["parts"]["qwen3_4b"]
    assert "foreach" in s["optimizers"]["actor"] and "fused" in s["optimizers"]["hf_peer"]
    assert s["goals"]["goals"]  # judged on what finished


# ------------------------------------------------------------------------------------------- MFU (issue 51)
def test_mfu_of_the_first_gpu_run_and_the_device_peaks():
    """The first GPU run's Qwen3-1.7B step (3 rows of 16,384, 21,258 tokens/s on an H200) is about 23 % MFU by the
    planner's count (issue 51); the peaks are plan.hardware's, for the SXM boards only."""
    from gpu_parts import mfu
    from gpu_parts import rows as R
    from gpu_parts.common import model_config

    lens = [p + r for p, r in R.fill_rows(3, 16384, seed=0)]
    assert sum(lens) == 47777  # the first run's batch (results/gpu-check-2026-12-04/summary.json)
    f = mfu.model_flops(model_config(gpu_check.Q17, False), lens)
    assert 6 * 1_720_574_976 < f["model_flops_per_token"] < 1.1 * 6 * 1_720_574_976  # attention: +7 % here
    part = mfu.annotate({**f, "step_s": 47777 / 21257.8, "logprob_pass": True}, 989.0)
    assert part["mfu"] == pytest.approx(0.238, abs=0.001) and part["achieved_tflops"] == pytest.approx(235, abs=1)
    assert part["mfu_with_logprob_pass"] == pytest.approx(part["mfu"] * 4 / 3, abs=1e-4)
    assert mfu.annotate(dict(f, step_s=1.0), None)["mfu"] is None  # no peak (CPU): FLOPs still reported
    assert mfu.device_peak("NVIDIA H200") == ("h200", 989.0)
    assert mfu.device_peak("NVIDIA H100 80GB HBM3") == ("h100", 989.0)
    assert mfu.device_peak("NVIDIA H100 PCIe") is None and mfu.device_peak("NVIDIA H200 NVL") is None
    assert gpu_check.peak_of({"cuda": True, "gpu": "NVIDIA H100 PCIe"}, None)["bf16_tflops"] is None
    assert gpu_check.peak_of({"cuda": True, "gpu": "NVIDIA H100 PCIe"}, 756.0)["bf16_tflops"] == 756.0


def test_issue51_goals_met_missed_and_unmeasured():
    from gpu_parts import goals as G

    parts = {"qwen3_1p7b": {"tokens_per_s": 36.0, "mfu": 0.36, "peak_over_estimate": 1.05},
             "hf_1p7b": {"tokens_per_s": 20.0}, "qwen3_4b": {"tokens_per_s": 15.0, "peak_over_estimate": 1.12},
             "hf_4b": {"tokens_per_s": 10.0}}
    g = G.judge(parts)["goals"]
    assert g["issue51_mfu_qwen3_1p7b"]["pass"] is True and g["issue51_tokens_per_s_vs_hf_qwen3_1p7b"]["pass"] is True
    assert g["issue51_tokens_per_s_vs_hf_qwen3_4b"]["pass"] is False  # 1.5x
    assert g["issue51_peak_vs_estimate"]["pass"] is False  # 4B 12 % over
    assert g["issue51_grouped_experts_qwen3_30b_a3b"]["pass"] is None  # no moe_grouped part ran
    parts["moe_grouped"] = {"speedup": 3.4, "within_bf16_error": True}
    assert G.judge(parts)["goals"]["issue51_grouped_experts_qwen3_30b_a3b"]["pass"] is True
    parts["moe_grouped"]["within_bf16_error"] = False
    assert G.judge(parts)["goals"]["issue51_grouped_experts_qwen3_30b_a3b"]["pass"] is False
    parts["qwen3_1p7b"]["mfu"] = 0.30
    assert G.judge(parts)["goals"]["issue51_mfu_qwen3_1p7b"]["pass"] is False
    empty = G.judge({})
    assert all(empty["goals"][k]["pass"] is None for k in empty["goals"] if k.startswith("issue51_"))
    assert "issue51_mfu_qwen3_1p7b" in empty["unmeasured"]


def test_profile_table_from_kernels_and_from_a_cpu_step(tmp_path):
    """GPU path on the profiler's event shapes: a kernel goes to the region its launching op sits in (log-probs,
    optimizer), else to its name's kind; kernels no op launched count by name; host gaps are the step's wall time
    the kernels leave idle. CPU path: a real profiled step of a tiny model, its trace written."""
    from types import SimpleNamespace as NS

    import torch

    from gpu_parts import profile_part as P

    def cpu(name, parent=None, kernels=()):
        return NS(name=name, cpu_parent=parent, device_type="DeviceType.CPU", self_cpu_time_total=0.0,
                  kernels=[NS(name=k, duration=d) for k, d in kernels])

    def kernel(name, start, end):
        return NS(name=name, device_type="DeviceType.CUDA", time_range=NS(start=start, end=end))

    lp = cpu(P.LOGPROBS)
    opt = cpu("Optimizer.step#AdamW.step", cpu(P.OPTIMIZER))
    events = [lp, cpu("aten::mm", lp, [("sm90_xmma_gemm_bf16", 300)]),
              cpu("aten::mm", None, [("nvjet_tst_128x256", 200)]),
              cpu("CompiledFunction", None, [("triton_poi_fused_add_mul_0", 50), ("triton_tem_fused_flex_0", 150)]),
              cpu("aten::_foreach_mul_", opt, [("multi_tensor_apply_kernel", 100)]),
              kernel("sm90_xmma_gemm_bf16", 0, 300), kernel("nvjet_tst_128x256", 300, 500),
              kernel("triton_poi_fused_add_mul_0", 500, 550), kernel("triton_tem_fused_flex_0", 550, 700),
              kernel("multi_tensor_apply_kernel", 800, 900), kernel("Memcpy HtoD (Pageable -> Device)", 850, 870),
              kernel("ncclDevKernel_AllReduce", 900, 920)]
    t = P.categorize(events, wall_us=1000.0, on_gpu=True)
    ms = {k: v["ms"] for k, v in t["categories"].items()}
    assert ms == {"matmul": 0.2, "attention": 0.15, "norms_elementwise": 0.05, "log_probs": 0.3, "optimizer": 0.1,
                  "copies": 0.02, "other": 0.02, "host_gaps": 0.18}, ms  # busy: 0-700, 800-920
    assert t["gpu_busy_ms"] == 0.82 and t["top"][0] == ["sm90_xmma_gemm_bf16", "log_probs", 0.3]

    lin = torch.nn.Linear(16, 32)
    head = torch.nn.Linear(32, 8)
    sgd = torch.optim.SGD([*lin.parameters(), *head.parameters()], lr=0.1)

    def step():
        torch.log_softmax(head(lin(torch.randn(4, 16))), -1).mean().backward()
        sgd.step()
        return {"time/actor/optimizer": 0.5}

    table = P.profile_in_budget(step, 0.01, time.monotonic() + 60, str(tmp_path), "toy",
                                [(sgd, "step", P.OPTIMIZER), (head, "forward", P.LOGPROBS)])
    assert "forward" not in vars(head) and "step" not in vars(sgd)  # put back
    cats = table["categories"]
    assert cats["matmul"]["ms"] > 0 and cats["log_probs"]["ms"] > 0 and cats["host_gaps"] is None
    assert table["trace"] == str(tmp_path / "toy.trace.json.gz") and table["step_timers_s"] == {"optimizer": 0.5}
    assert "log_probs" in P.format_profile("toy", table)
    assert "skipped" in P.profile_in_budget(step, 10.0, time.monotonic() + 5, str(tmp_path), "late", [])
