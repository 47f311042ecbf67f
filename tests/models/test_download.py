"""`m2po download`: the real huggingface_hub.snapshot_download fetches a tiny model from a hub served on
localhost (its HTTP API: revision, tree, resolve; no network), into the recipe's model.hf_path, and the check
passes; broken repositories (a missing shard, a missing tensor, other shapes than the recipe's hf_config, no
tokenizer) exit 2 naming the problem; `m2po config` names the command when the weights are missing.

A local hub rather than a pre-filled HF cache: the command downloads into model.hf_path (huggingface_hub's
local_dir mode), which offline mode never fills from the cache, so only a served repository runs that path."""
from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
import torch
from safetensors.torch import save

from m2po_megatron.cli import main
from m2po_megatron.models.hf_config import read_hf_config
from m2po_megatron.models.weights import expected_hf_shapes
from tiny import tiny_config

REPO_ID = "test-org/tiny-qwen3"


@pytest.fixture(scope="module")
def repo_files() -> dict[str, bytes]:
    """A complete tiny Qwen3 repository: config, tokenizer, two safetensors shards with their index, and a
    README the download must skip."""
    from m2po_megatron.demo.tiny_tokenizer import build_tiny_tokenizer

    cfg = tiny_config("qwen3")
    names = sorted(expected_hf_shapes(read_hf_config(cfg)).items())
    half = len(names) // 2
    files = {"config.json": json.dumps(cfg).encode(), "README.md": b"# tiny\n"}
    weight_map = {}
    for k, part in enumerate((names[:half], names[half:])):
        fn = f"model-0000{k + 1}-of-00002.safetensors"
        files[fn] = save({n: torch.zeros(s, dtype=torch.bfloat16) for n, s in part})
        weight_map.update({n: fn for n, _ in part})
    files["model.safetensors.index.json"] = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        build_tiny_tokenizer().save_pretrained(d)
        for p in Path(d).iterdir():
            files[p.name] = p.read_bytes()
    return files


class Hub:
    """The hub's model API for one repository at one commit, on an ephemeral localhost port."""

    def __init__(self, files: dict[str, bytes]):
        self.files = files
        self.sha = hashlib.sha1(json.dumps(sorted(files)).encode()).hexdigest()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                hub.answer(self, head=False)

            def do_HEAD(self):
                hub.answer(self, head=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        # a short poll: shutdown() waits up to one poll interval
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def answer(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlparse(h.path).path)
        body, headers, code = b'{"error": "not found"}', {"X-Error-Code": "RepoNotFound"}, 404
        if path.startswith(f"/api/models/{REPO_ID}/revision/"):
            body, code = json.dumps({"id": REPO_ID, "sha": self.sha}).encode(), 200
        elif path.startswith(f"/api/models/{REPO_ID}/tree/"):
            body, code = json.dumps([{"type": "file", "path": p, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                                     for p, b in self.files.items()]).encode(), 200
        elif path.startswith(f"/{REPO_ID}/resolve/"):
            name = path.split("/", 5)[-1]
            if name in self.files:
                body, code = self.files[name], 200
                headers = {"X-Repo-Commit": self.sha, "ETag": f'"{hashlib.sha1(body).hexdigest()}"'}
            else:
                headers = {"X-Error-Code": "EntryNotFound"}
        h.send_response(code)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def online(monkeypatch, tmp_path):
    """huggingface_hub online (tests/conftest.py sets HF_HUB_OFFLINE; its constants were read at import), its
    HF_HOME under tmp_path; serve(files) starts a hub and points HF_ENDPOINT at it."""
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    hubs = []

    def serve(files):
        hubs.append(Hub(files))
        monkeypatch.setenv("HF_ENDPOINT", hubs[-1].url)
        return hubs[-1]

    yield serve
    for h in hubs:
        h.close()


def write_recipe(tmp_path: Path, reference: dict | None = None) -> tuple[Path, Path]:
    """A recipe (the tiny CPU one) whose model is REPO_ID at tmp_path/weights, planned for `reference` (default:
    the served model's config)."""
    ref = tmp_path / "ref" / "config.json"
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(json.dumps(reference or tiny_config("qwen3")))
    target = tmp_path / "weights" / "tiny-qwen3"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"extends: tiny-cpu\nmodel:\n  hf_path: {target}\n  hf_config: {ref}\n  hf_id: {REPO_ID}\n")
    return recipe, target


def test_download_fetches_checks_and_then_only_verifies(tmp_path, online, repo_files, capsys):
    recipe, target = write_recipe(tmp_path)
    hub = online(repo_files)
    assert main(["download", str(recipe)]) == 0, capsys.readouterr().err
    have = {p.name for p in target.iterdir() if p.is_file()}
    assert set(repo_files) - have == {"README.md"}  # only what the recipes read
    assert "weights, config and tokenizer check out" in capsys.readouterr().out
    (target / "model-00002-of-00002.safetensors").unlink()  # an interrupted download: completed, not refused
    assert main(["download", str(recipe)]) == 0
    assert "resuming the download" in capsys.readouterr().out
    assert (target / "model-00002-of-00002.safetensors").is_file()
    hub.close()  # a complete directory is checked, not downloaded again: no hub needed
    assert main(["download", str(recipe)]) == 0
    assert "nothing to download" in capsys.readouterr().out
    assert main(["download", str(recipe), "--dry-run"]) == 0
    assert f"{target}: complete" in capsys.readouterr().out


def _without(files: dict, *names: str) -> dict:
    return {k: v for k, v in files.items() if k not in names}


def _drop_tensor(files: dict) -> tuple[dict, str]:
    """Shard 1 rewritten without its first tensor, the index still listing it elsewhere: the converter's list
    finds it missing."""
    from safetensors.torch import load

    shard = load(files["model-00001-of-00002.safetensors"])
    gone = sorted(shard)[0]
    del shard[gone]
    index = json.loads(files["model.safetensors.index.json"])
    del index["weight_map"][gone]
    return {**files, "model-00001-of-00002.safetensors": save(shard),
            "model.safetensors.index.json": json.dumps(index).encode()}, gone


@pytest.mark.parametrize("case", ["missing shard", "missing tensor", "other shapes", "no tokenizer"])
def test_a_broken_download_exits_2_naming_the_problem(tmp_path, online, repo_files, capsys, case):
    reference = None
    files = repo_files
    if case == "missing shard":
        files, expect = _without(files, "model-00002-of-00002.safetensors"), "model-00002-of-00002.safetensors"
    elif case == "missing tensor":
        files, gone = _drop_tensor(files)
        expect = f"missing tensors (1): {gone}"
    elif case == "other shapes":  # the recipe was planned for a deeper, wider-vocabulary model
        reference, expect = tiny_config("qwen3", num_hidden_layers=3, vocab_size=1024), "num_layers: downloaded 2"
    else:
        files = {k: v for k, v in files.items() if not k.startswith(("tokenizer", "vocab", "merges", "special",
                                                                        "added", "chat_template"))}
        expect = "tokenizer: none of tokenizer.json"
    recipe, target = write_recipe(tmp_path, reference)
    online(files)
    assert main(["download", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "m2po download: downloaded test-org/tiny-qwen3 into" in err and expect in err, err
    if case == "other shapes":
        assert "vocab_size: downloaded 512, expected 1024" in err and "fix the recipe" in err


def test_an_existing_foreign_directory_is_never_overwritten(tmp_path, online, repo_files, capsys):
    """A directory `m2po download` did not write (a converted model, say) that fails the check is left alone."""
    recipe, target = write_recipe(tmp_path)
    target.mkdir(parents=True)
    (target / "config.json").write_text(json.dumps(tiny_config("qwen3")))
    online(repo_files)
    assert main(["download", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "was not written by `m2po download`" in err and "no *.safetensors weights" in err
    assert [p.name for p in target.iterdir()] == ["config.json"]


def test_offline_and_bad_input_exit_2_before_any_transfer(tmp_path, monkeypatch, capsys):
    """HF_HUB_OFFLINE (which tests/conftest.py sets) names itself; a recipe with no hub repo, a bare id without
    ORG/NAME, and --out with a recipe name the fix."""
    recipe, target = write_recipe(tmp_path)
    assert main(["download", str(recipe)]) == 2
    assert "HF_HUB_OFFLINE" in capsys.readouterr().err and not target.exists()
    assert main(["download", str(recipe), "model.hf_id=null", "model.hf_config=null"]) == 2
    assert "set model.hf_id" in capsys.readouterr().err
    assert main(["download", "tiny-cpu"]) == 2
    assert "is built by `m2po demo`" in capsys.readouterr().err
    assert main(["download", "Qwen3-8B-Base", "--out", str(tmp_path / "x")]) == 2
    assert "write it as ORG/NAME" in capsys.readouterr().err
    assert main(["download", str(recipe), "--out", str(tmp_path / "x")]) == 2
    assert "give a hub repo id" in capsys.readouterr().err


def test_a_bare_hub_id_plans_against_the_bundled_config(tmp_path, capsys):
    assert main(["download", "Qwen/Qwen3-8B-Base", "--out", str(tmp_path / "q"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"model Qwen/Qwen3-8B-Base -> {tmp_path / 'q'}" in out
    assert "assets/configs/Qwen__Qwen3-8B-Base/config.json" in out and "would be downloaded" in out


def test_m2po_config_names_the_download_command_for_missing_weights(tmp_path, monkeypatch):
    from m2po_megatron.config import ConfigError, load_config

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("M2PO_MODELS_DIR", str(tmp_path / "models"))
    with pytest.raises(ConfigError) as e:
        load_config("paper/qwen3-8b-base")
    msg = str(e.value)
    assert (f"fetch the weights with `m2po download RECIPE` (the hub's Qwen/Qwen3-8B-Base into "
            f"{tmp_path / 'models' / 'Qwen3-8B-Base'}, then checked)") in msg
    assert "set M2PO_MODELS_DIR" in msg  # the other way stays named
