"""The container recipe (docker/) installs exactly requirements/'s versions, and slurm/m2po.sbatch enters the
image when M2PO_CONTAINER is set (its M2PO_DRY_RUN=1 mode prints the job's commands; no Slurm is started)."""
from __future__ import annotations

import ast
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "Dockerfile"


def _load_pins():
    spec = importlib.util.spec_from_file_location("m2po_docker_pins", REPO / "docker" / "pins.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


pins = _load_pins()


def _run_lines() -> list[str]:
    """The Dockerfile's RUN instructions, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    return [ln[4:] for ln in text.splitlines() if ln.startswith("RUN ")]


def _setup_list(name: str) -> list[str]:
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and node.targets[0].id == name:
            return ast.literal_eval(node.value)
    raise AssertionError(f"setup.py has no {name}")


def test_every_pip_install_takes_only_the_pinned_files():
    installs = [cmd for run in _run_lines() for cmd in run.split("&&") if "pip install" in cmd]
    assert len(installs) == 4, installs
    allowed_files = {"docker/requirements-trainer.txt", "/tmp/sglang-install.txt"}
    for cmd in installs:
        words = shlex.split(cmd.split("pip install", 1)[1].split(";")[0])
        reqs, files, i = [], [], 0
        while i < len(words):
            if words[i] in ("-r", "-c"):
                files += [words[i + 1]] if words[i] == "-r" else []
                i += 2
                continue
            reqs += [] if words[i].startswith("-") else [words[i]]
            i += 1
        assert set(files) <= allowed_files, cmd
        if "apex" in cmd:
            assert reqs == ['apex @ git+https://github.com/NVIDIA/apex.git@${APEX_REF}'] and "--no-deps" in words
        elif "." in reqs:  # the project itself: no dependency may come in unpinned
            assert reqs == ["."] and "--no-deps" in words and "--no-build-isolation" in words
        else:
            assert reqs == [], f"a package named outside the pinned files: {cmd}"
    trainer = next(c for c in installs if "requirements-trainer" in c)
    assert "-c /opt/m2po/base.txt" in trainer and "-c /tmp/constraints.txt" in trainer  # NGC torch stays
    assert "--no-deps" in next(c for c in installs if "sglang-install" in c)


def test_apex_is_optional_behind_a_build_arg_and_the_base_is_ngc_pytorch():
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG WITH_APEX=0$", text, re.M) and re.search(r"^ARG APEX_REF=$", text, re.M)
    apex_run = next(r for r in _run_lines() if "apex" in r)
    assert apex_run.lstrip().startswith('if [ "$WITH_APEX" = 1 ]; then') and "exit 2" in apex_run
    tag = re.search(r"^ARG NGC_TAG=(\S+)$", text, re.M).group(1)
    assert re.fullmatch(r"\d\d\.\d\d-py3", tag)
    assert re.search(r"^FROM nvcr\.io/nvidia/pytorch:\$\{NGC_TAG\}$", text, re.M)
    assert re.search(r"^ENV PIP_CONSTRAINT= ", text, re.M)  # NGC's own list would fight the lock


def test_trainer_requirements_are_setup_py_at_the_lock_versions():
    lock = pins.read_pins(pins.LOCK)
    trainer = pins.read_pins(pins.TRAINER)  # raises on any line that is not name==version
    for n, (req, v) in trainer.items():
        assert n in lock and lock[n][1] == v, f"{req}=={v}: lock.txt has {lock.get(n)}"
    core = {pins.norm(re.split(r"[<>=!~;\[ ]", r)[0]) for r in _setup_list("CORE")}
    assert core - {"torch"} <= set(trainer), core - set(trainer)
    assert "torch" not in trainer and not any(pins.base_owned(n) for n in trainer)
    assert trainer["ray"][0] == "ray[default]"


def test_sglang_closure_has_the_contract_pins_and_nothing_the_lock_or_ngc_owns():
    contract = pins.read_pins(pins.CONTRACT)
    sglang = pins.read_pins(pins.SGLANG)
    assert contract["sglang"][1] == "0.5.23" == sglang["sglang"][1]
    assert sglang["sglang-router"][1] == contract["sglang-router"][1]
    assert any(r.startswith('"sglang==0.5.23"') or r == "sglang==0.5.23" for r in _setup_list("GPU"))
    assert not set(sglang) & set(pins.read_pins(pins.LOCK)), "the lock's versions must win"
    assert not set(sglang) & pins.BASE_NAMES


def test_read_pins_refuses_anything_but_an_exact_pin(tmp_path):
    for bad in ("numpy>=2", "numpy", "numpy==2.5.5 ; python_version<'3.13'", "git+https://x/y.git"):
        f = tmp_path / "r.txt"
        f.write_text(f"# comment\n{bad}\n")
        with pytest.raises(ValueError, match="r.txt:2"):
            pins.read_pins(f)


def test_constraints_keep_the_base_torch_and_pin_the_rest():
    lines = pins.lock_constraints({"torch", "numpy"})
    names = {pins.norm(ln.split("==")[0]) for ln in lines}
    assert "torch" not in names and "numpy" not in names and "triton" not in names
    assert not any(n.startswith("nvidia-") and n in pins.read_pins(pins.LOCK) for n in names)
    assert "megatron-core==0.19.2" in lines and "sglang==0.5.23" in lines


def test_check_reports_a_version_off_its_pin(tmp_path):
    import setuptools  # noqa: F401  (puts its _vendor copies of packaging and platformdirs on sys.path)

    have = pins.installed()  # this checkout's .venv: the lock's trainer stack, no TE, no sglang
    assert have["packaging"] == pins.read_pins(pins.LOCK)["packaging"][1]  # not setuptools' vendored copy
    problems = pins.check(have, files=(pins.TRAINER,))
    assert [p for p in problems if "Transformer Engine" not in p] == []
    off = tmp_path / "req.txt"
    off.write_text("megatron-core==0.0.1\n")
    problems = pins.check(have, files=(off,))
    assert f"megatron-core is {have['megatron-core']}, req.txt pins 0.0.1" in problems
    assert any("torch" in p for p in pins.base_problems({"torch": "2.13.0a0+abc"}, (3, 12)))
    assert pins.base_problems({"torch": "2.14.0a0+abc"}, (3, 12)) == []  # NGC's numbering of the release


def _dry_run(tmp_path: Path, **env: str) -> subprocess.Popen:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("M2PO_", "SLURM_"))}
    full.update(M2PO_HOME=str(REPO), M2PO_DRY_RUN="1", SLURM_JOB_NODELIST="n1,n2", SLURM_JOB_ID="7",
                M2PO_PYTHON=sys.executable if "M2PO_CONTAINER" not in env else "python", **env)
    return subprocess.Popen(["bash", str(REPO / "slurm" / "m2po.sbatch"), "tests/slurm/recipes/two-node.yaml",
                             f"run.output_dir={tmp_path}"], env=full, cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _steps(proc: subprocess.Popen) -> dict[str, str]:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    return dict(re.match(r"dry-run (\w+): (.*)", ln).groups() for ln in out.splitlines() if ln.startswith("dry-run"))


def test_slurm_scripts_parse_and_the_container_reaches_every_step(tmp_path):
    for script in ("m2po.sbatch", "ray_node.sh", "container.sh"):
        res = subprocess.run(["bash", "-n", str(REPO / "slurm" / script)], capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr
    runs = {"none": _dry_run(tmp_path),  # in parallel: each reads the recipe's layout (a python start)
            "pyxis": _dry_run(tmp_path, M2PO_CONTAINER="/img/m2po.sqsh", M2PO_CONTAINER_MOUNTS="/models:/m"),
            "apptainer": _dry_run(tmp_path, M2PO_CONTAINER="/img/m2po.sif")}
    steps = {k: _steps(p) for k, p in runs.items()}
    run_dir = str(tmp_path / "two-node")
    for kind in steps:
        assert set(steps[kind]) == {"layout", "head", "health", "workers", "wait", "driver"}
    # no container: today's commands, nothing of either runtime
    assert not any("container" in c or "apptainer" in c for c in steps["none"].values())
    assert steps["none"]["head"].startswith("srun --overlap --kill-on-bad-exit=1 --ntasks-per-node=1 -N1 -n1 -w n1")
    # pyxis: every srun carries the image and the mounts; the batch shell's helpers go through srun too
    mounts = f"--container-mounts={REPO}:{REPO}\\,/tmp:/tmp\\,{run_dir}:{run_dir}\\,/models:/m"
    for step, cmd in steps["pyxis"].items():
        assert cmd.startswith("srun ") and "--container-image=/img/m2po.sqsh" in cmd, (step, cmd)
        assert mounts in cmd and "--container-name=m2po-7" in cmd, (step, cmd)
    assert "-w n2" in steps["pyxis"]["workers"] and "--job-name=m2po-driver" in steps["pyxis"]["driver"]
    assert " python -m m2po_megatron.cli train " in steps["pyxis"]["driver"]
    # apptainer: every command runs inside `apptainer exec`, the srun steps keep their options
    prefix = "apptainer exec --nv --bind "
    for step, cmd in steps["apptainer"].items():
        assert prefix in cmd and "/img/m2po.sif " in cmd and "--container" not in cmd, (step, cmd)
    assert steps["apptainer"]["driver"].startswith("srun ") and steps["apptainer"]["health"].startswith(prefix)


def test_a_bad_container_runtime_fails_before_any_step(tmp_path):
    proc = _dry_run(tmp_path, M2PO_CONTAINER="/img/x.sqsh", M2PO_CONTAINER_RUNTIME="docker")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "M2PO_CONTAINER_RUNTIME=docker: use pyxis or apptainer" in err
    assert "dry-run" not in out
