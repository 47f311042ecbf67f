"""docs/reproduce.md's data step, followed literally: its bash block is run by bash (expansions, defaults,
redirections as written) with `m2po` recording each call, the calls then run in this process against an
offline HF cache of recorded upstream rows, and the paper recipe's data paths must then all exist."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from _hub_cache import fill_cache
from m2po_megatron.cli import main
from m2po_megatron.config import load_config
from m2po_megatron.config.files import check_data_files

REPO = Path(__file__).resolve().parents[2]


def _data_block() -> str:
    text = (REPO / "docs" / "reproduce.md").read_text()
    step = text[text.index("2. **Data**"):text.index("3. **Check, submit, follow**")]
    blocks = re.findall(r"```bash\n(.*?)```", step, re.DOTALL)
    assert len(blocks) == 1, "the data step should hold one bash block"
    return blocks[0]


def _recorded_calls(block: str, cwd: Path, env: dict) -> list[list[str]]:
    """Run the block in bash with `m2po` a function that writes its argv (NUL-separated) to a file."""
    rec = cwd / "calls"
    script = ('set -euo pipefail\nn=0\nm2po() { n=$((n+1)); printf "%s\\0" "$@" > "$M2PO_TEST_CALLS.$n"; }\n'
              + block)
    subprocess.run(["bash", "-c", script], cwd=cwd, env={**env, "M2PO_TEST_CALLS": str(rec)}, check=True,
                   timeout=30)
    files = sorted(cwd.glob("calls.*"), key=lambda p: int(p.suffix[1:]))
    return [p.read_bytes().decode().split("\0")[:-1] for p in files]


def _data_errors(recipe: str) -> list[str]:
    errors: list[str] = []
    check_data_files(load_config(recipe, check_files=False), errors)
    return errors


def test_reproduce_data_step_writes_where_the_paper_recipes_read(tmp_path, monkeypatch):
    import os

    fill_cache(tmp_path, monkeypatch)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.delenv("M2PO_DATA_DIR", raising=False)  # the doc's own default must do
    calls = _recorded_calls(_data_block(), work, {k: v for k, v in os.environ.items() if k != "M2PO_DATA_DIR"})
    assert [c[0] for c in calls] == ["prepare-data", "config"], calls
    data_dir = work / "data"
    monkeypatch.setenv("M2PO_DATA_DIR", str(data_dir))  # what the block's `export` set for its own commands
    recipe = str(REPO / calls[1][1])
    assert _data_errors(recipe), "the recipe's data paths must be missing before the data step"
    assert main(calls[0]) == 0
    assert _data_errors(recipe) == []  # `m2po config`'s file checks for data pass (model weights are step 1)
    report = json.loads((data_dir / "deepscaler" / "prepare_report.json").read_text())
    assert report["train"]["rows_out"] == 6 and sorted(report["eval"]) == sorted(
        ["math500", "aime24", "aime25", "amc23", "amc24", "gaokao2023en", "minerva_math", "olympiadbench"])
