"""An offline Hugging Face cache (and M2PO download cache) filled from tests/data/fixtures/hub, so that the real
huggingface_hub.snapshot_download and datasets code read the recorded upstream rows as they would the hub's."""
from __future__ import annotations

import hashlib
import shutil
from dataclasses import replace
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures" / "hub"
FAKE_COMMIT = "0" * 39 + "1"  # any 40-hex name: the cache maps refs/main to a snapshot folder of that name


def fill_cache(tmp: Path, monkeypatch) -> Path:
    """An HF hub cache under tmp holding every fixture dataset, offline mode on, and the GaoKao file served
    from the fixture (its URL and sha256 pointed there). Returns the hub cache directory."""
    import huggingface_hub.constants as hc

    from m2po_megatron.data import hub

    cache = tmp / "hf-hub"
    for src in FIXTURES.iterdir():
        if src.name in ("expected", "Infini-AI-Lab__M2PO") or not src.is_dir():
            continue
        org, name = src.name.split("__", 1)
        bench = next((b for b in hub.BENCHMARKS.values() if b.source == f"{org}/{name}"), None)
        commit = bench.revision if bench and bench.revision else FAKE_COMMIT
        repo = cache / f"datasets--{org}--{name}"
        shutil.copytree(src, repo / "snapshots" / commit)
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    # the constants were read at import; the subprocess-free tests set them as a new process would
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    gaokao = FIXTURES / "Infini-AI-Lab__M2PO" / "raw-data" / "gaokao-2023en-test.jsonl"
    monkeypatch.setitem(hub.BENCHMARKS, "gaokao2023en", replace(
        hub.BENCHMARKS["gaokao2023en"], source=gaokao.resolve().as_uri(),
        sha256=hashlib.sha256(gaokao.read_bytes()).hexdigest()))
    monkeypatch.setenv("M2PO_CACHE", str(tmp / "m2po-cache"))
    return cache
