"""docs/quickstart.md, followed literally up to what needs a GPU, the network or a cluster.

Its bash blocks run, in order, in one bash (its exports, defaults and redirections as written) with `m2po`,
`sbatch`, `docker` and `enroot` recording their arguments; then each block tagged `cpu` is run for real (the
`m2po` calls in this process, from another working directory), the `cluster` submission runs the batch script
in its dry mode, and the `network` calls are checked against the tests that serve them offline. Every block
must carry a tag, so a new command cannot go untested silently.
"""
from __future__ import annotations

import os
import re
import sys
import subprocess
from pathlib import Path

import pytest
import yaml

from m2po_megatron.cli import main

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "quickstart.md"
TAGS = ("cpu", "network", "cluster")
RECORDED = ("m2po", "sbatch", "docker", "enroot")


def _blocks() -> list[tuple[str, str]]:
    """(tag, bash text) of every bash block, in order."""
    text = DOC.read_text()
    found = re.findall(r"(<!-- quickstart: (\w+)[^>]*-->\n)?```bash\n(.*?)```", text, re.DOTALL)
    return [(tag, body) for _, tag, body in found]


def _record(blocks: list[tuple[str, str]], rec: Path, env: dict) -> tuple[list[tuple[str, list[str]]], Path, dict]:
    """Run every block in one bash, from the checkout as the page says, with the RECORDED commands writing their
    argv under `rec`: (tag, argv) per call, the directory the blocks ended in and the M2PO_* they exported."""
    script = ["set -euo pipefail", "n=0"]
    for name in RECORDED:
        script.append(f'{name}() {{ n=$((n+1)); printf "%s\\0" {name} "$@" > "$QS_CALLS.$n.$QS_TAG"; }}')
    for tag, body in blocks:
        script += [f"QS_TAG={tag}", body]
    script.append('pwd > "$QS_CALLS.pwd"; env | grep "^M2PO_" > "$QS_CALLS.env" || true')
    subprocess.run(["bash", "-c", "\n".join(script)], cwd=REPO, env={**env, "QS_CALLS": str(rec / "call")},
                   check=True, timeout=60)
    calls = sorted((p for p in rec.glob("call.*") if p.name.split(".")[1].isdigit()),
                   key=lambda p: int(p.name.split(".")[1]))
    exported = dict(line.split("=", 1) for line in (rec / "call.env").read_text().splitlines())
    return ([(p.name.split(".")[2], p.read_bytes().decode().split("\0")[:-1]) for p in calls],
            Path((rec / "call.pwd").read_text().strip()), exported)


def test_every_block_is_tagged_and_the_steps_are_in_order():
    blocks = _blocks()
    assert len(blocks) >= 5
    assert all(tag in TAGS for tag, _ in blocks), [t for t, _ in blocks]
    text = DOC.read_text()
    for link in re.findall(r"docs/([\w-]+\.md)", text):
        assert (REPO / "docs" / link).is_file(), link


@pytest.mark.timeout(600)
def test_quickstart_cpu_part_runs_as_written(tmp_path, monkeypatch, capsys):
    env = {k: v for k, v in os.environ.items() if not k.startswith("M2PO_")}
    env["HOME"] = str(tmp_path / "home")  # the page's work directory defaults to ~/m2po
    calls, work, exported = _record(_blocks(), tmp_path, env)
    assert work == tmp_path / "home" / "m2po" and exported["M2PO_HOME"] == str(REPO)
    verbs = [(tag, argv[0], argv[1] if argv[0] == "m2po" else None) for tag, argv in calls]
    assert [v[1:] for v in verbs] == [
        ("docker", None), ("enroot", None), ("m2po", "download"), ("m2po", "download"),
        ("m2po", "prepare-data"), ("m2po", "config"), ("m2po", "plan"), ("m2po", "rehearse"),
        ("sbatch", None), ("m2po", "report")], verbs

    monkeypatch.chdir(work)
    for k, v in exported.items():
        monkeypatch.setenv(k, v)
    by_verb = {(argv[0], argv[1] if argv[0] == "m2po" else None, tag): argv[1:] for tag, argv in calls}

    # step 2: where the weights go, without the network
    args = by_verb[("m2po", "download", "cpu")]
    assert main(args) == 0
    assert "Qwen/Qwen3-1.7B-Base" in capsys.readouterr().out
    # the network commands: the download is served by a local hub in tests/models/test_download.py, and the
    # data command is docs/reproduce.md's, which tests/data/test_reproduce_data_step.py runs offline
    assert by_verb[("m2po", "download", "network")] == ["download", "paper/qwen3-1.7b-base"]
    reproduce = (REPO / "docs" / "reproduce.md").read_text()
    assert "m2po " + " ".join(by_verb[("m2po", "prepare-data", "network")]).replace(
        str(work / "data"), "$M2PO_DATA_DIR") in reproduce

    # `m2po config` without weights or data: exit 2, naming the command that fetches the weights
    cfg_args = by_verb[("m2po", "config", "cpu")]
    assert main(cfg_args) == 2
    err = capsys.readouterr().err
    assert "m2po download" in err and "model.hf_path" in err
    assert main([*cfg_args, "--no-check-files"]) == 0
    capsys.readouterr()

    # step 3: plan, then rehearse what was planned
    assert main(by_verb[("m2po", "plan", "cpu")]) == 0
    planned = work / "planned.yaml"
    assert planned.is_file() and "extends" in yaml.safe_load(planned.read_text())
    capsys.readouterr()
    assert main(by_verb[("m2po", "rehearse", "cpu")]) == 0, capsys.readouterr().out[-3000:]

    # step 4: the submission, through the batch script's dry mode (no Slurm): the driver trains planned.yaml
    sbatch = by_verb[("sbatch", None, "cluster")]
    script = next(a for a in sbatch if a.endswith(".sbatch"))
    rest = sbatch[sbatch.index(script) + 1:]
    dry = subprocess.run(["bash", script, *rest], cwd=work, capture_output=True, text=True, timeout=120,
                         env={**env, **exported, "M2PO_DRY_RUN": "1", "SLURM_JOB_NODELIST": "n1,n2",
                              "SLURM_JOB_ID": "7", "M2PO_PYTHON": sys.executable})
    assert dry.returncode == 0, dry.stdout[-2000:] + dry.stderr[-2000:]
    assert f"train {work}/planned.yaml" in dry.stdout and "run.resume=auto" in dry.stdout
    assert f"{work}/runs/" in dry.stdout  # the run directory is where sbatch was called
