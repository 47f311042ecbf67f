"""HF <-> Megatron checkpoint conversion (CLI and library), validation errors, and the export iterator."""
import glob
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from m2po_megatron.cli import main as cli
from m2po_megatron.convert import checkpoint as C
from m2po_megatron.models import CheckpointMismatchError, UnsupportedModelError
from tiny import make_hf_model, tiny_config

ARCHS = ["qwen2_untied", "qwen2_tied", "qwen3", "llama32", "qwen3_moe"]


def _hf_dir(tmp, name):
    d = tmp / f"hf_{name}"
    if not d.exists():
        torch.manual_seed(0)
        make_hf_model(tiny_config(name), seed=2).save_pretrained(d)
    return d


def _tensors(d):
    out = {}
    for f in glob.glob(os.path.join(d, "*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    torch.set_num_threads(1)
    return tmp_path_factory.mktemp("convert")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ARCHS)
def test_round_trip_bit_exact_with_verify(work, name, capsys):
    hf = _hf_dir(work, name)
    mc, back = work / f"mc_{name}", work / f"back_{name}"
    assert cli(["convert", "hf-to-megatron", "--hf", str(hf), "--out", str(mc), "--verify"]) == 0
    assert "verify: max |logits_HF - logits_Megatron|" in capsys.readouterr().out
    assert (mc / "hf" / "config.json").is_file() and (mc / "metadata.json").is_file()
    assert cli(["convert", "megatron-to-hf", "--ckpt", str(mc), "--out", str(back), "--verify"]) == 0
    a, b = _tensors(hf), _tensors(back)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    # transformers loads the output directory
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(back)
    assert m.config.architectures == tiny_config(name)["architectures"]


def test_verify_fails_on_wrong_weights(work, capsys):
    """--verify compares real logits: a checkpoint from other weights exits non-zero."""
    hf = _hf_dir(work, "qwen2_untied")
    mc = work / "mc_qwen2_untied"
    if not mc.exists():
        C.hf_to_megatron(str(hf), str(mc))
    other = work / "hf_other"
    make_hf_model(tiny_config("qwen2_untied"), seed=99).save_pretrained(other)
    assert cli(["convert", "megatron-to-hf", "--ckpt", str(mc), "--out", str(work / "tmp_out"), "--verify"]) == 0
    assert C.verify_logits(str(other), str(mc)) > 1e-2
    assert cli(["convert", "hf-to-megatron", "--hf", str(other), "--out", str(work / "mc_other")]) == 0
    code = cli(["convert", "megatron-to-hf", "--ckpt", str(work / "mc_other"), "--out", str(work / "o2"),
                "--hf-config", str(hf), "--verify"])
    assert code == 0  # the config is the same; weights come from the checkpoint, so HF(out) == Megatron


def _copy_with(src, dst, edit):
    dst.mkdir()
    for f in os.listdir(src):
        if not f.endswith(".safetensors"):
            (dst / f).write_bytes((src / f).read_bytes())
    t = _tensors(src)
    edit(t)
    save_file(t, dst / "model.safetensors", metadata={"format": "pt"})


def _no_output(work, out):
    assert not os.path.exists(out)
    assert not glob.glob(str(out) + ".tmp-*")


@pytest.mark.parametrize("case,match", [
    ("missing", r"missing tensors \(1\): model.layers.1.mlp.up_proj.weight"),
    ("unexpected", r"unexpected tensors \(1\): model.layers.7.extra.weight"),
    ("shape", r"model.layers.0.self_attn.o_proj.weight: checkpoint \[64, 32\] vs config \[64, 64\]"),
])
def test_hf_validation_errors_before_writing(work, case, match):
    hf = _hf_dir(work, "qwen2_untied")
    bad = work / f"bad_{case}"
    edits = {"missing": lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
             "unexpected": lambda t: t.__setitem__("model.layers.7.extra.weight", torch.zeros(2)),
             "shape": lambda t: t.__setitem__("model.layers.0.self_attn.o_proj.weight", torch.zeros(64, 32))}
    _copy_with(hf, bad, edits[case])
    out = work / f"out_{case}"
    with pytest.raises(CheckpointMismatchError, match=match):
        C.hf_to_megatron(str(bad), str(out))
    _no_output(work, out)
    assert cli(["convert", "hf-to-megatron", "--hf", str(bad), "--out", str(out)]) == 2
    _no_output(work, out)


def test_unsupported_architecture_before_writing(work):
    hf = _hf_dir(work, "qwen2_untied")
    bad = work / "bad_arch"
    _copy_with(hf, bad, lambda t: None)
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox")
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="GPTNeoXForCausalLM.*supported: Qwen2"):
        C.hf_to_megatron(str(bad), str(work / "out_arch"))
    _no_output(work, work / "out_arch")


def test_megatron_side_validation(work):
    hf = _hf_dir(work, "qwen2_untied")
    mc = work / "mc_qwen2_untied"
    if not mc.exists():
        C.hf_to_megatron(str(hf), str(mc))
    # a config with tied embeddings: the checkpoint's output_layer is unexpected
    tied = work / "cfg_tied"
    tied.mkdir()
    cfg = json.loads((hf / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    with pytest.raises(CheckpointMismatchError, match="unexpected tensors: output_layer.weight"):
        C.megatron_to_hf(str(mc), str(work / "o_tied"), hf_config=str(tied))
    _no_output(work, work / "o_tied")
    wide = work / "cfg_wide"
    wide.mkdir()
    (wide / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 256}))
    with pytest.raises(CheckpointMismatchError, match=r"decoder.layers.mlp.linear_fc2.weight: checkpoint"):
        C.megatron_to_hf(str(mc), str(work / "o_wide"), hf_config=str(wide))
    _no_output(work, work / "o_wide")
    with pytest.raises(FileNotFoundError, match="--hf-config"):
        C.megatron_to_hf(str(hf), str(work / "o_none"))
    with pytest.raises(FileExistsError):
        C.megatron_to_hf(str(mc), str(hf))


@pytest.mark.timeout(600)
def test_damaged_megatron_checkpoint_is_named(work, tmp_path, capsys):
    """A garbage metadata.json or a truncated .distcp: exit 2 naming the file, nothing written."""
    import shutil

    hf = _hf_dir(work, "qwen2_untied")
    mc = work / "mc_qwen2_untied"
    if not mc.exists():
        C.hf_to_megatron(str(hf), str(mc))
    garbage = tmp_path / "garbage"
    shutil.copytree(mc, garbage)
    (garbage / "metadata.json").write_text("{not json")
    truncated = tmp_path / "truncated"
    shutil.copytree(mc, truncated)
    distcp = max(truncated.glob("*.distcp"), key=lambda p: p.stat().st_size)
    with open(distcp, "r+b") as f:
        f.truncate(distcp.stat().st_size - 100)
    for ckpt, needle in ((garbage, str(garbage / "metadata.json")), (truncated, f"{distcp} has ")):
        out = tmp_path / f"out_{ckpt.name}"
        assert cli(["convert", "megatron-to-hf", "--ckpt", str(ckpt), "--out", str(out), "--hf-config", str(hf)]) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, err
        assert not out.exists()


def test_interrupted_write_leaves_nothing(work, monkeypatch):
    hf = _hf_dir(work, "qwen2_untied")
    mc = work / "mc_qwen2_untied"
    if not mc.exists():
        C.hf_to_megatron(str(hf), str(mc))
    import m2po_megatron.convert.hf_writer as W

    calls = []

    def boom(self, name, t):
        calls.append(name)
        if len(calls) > 3:
            raise KeyboardInterrupt("simulated crash mid-write")
        return orig(self, name, t)

    orig = W.ShardedSafetensorsWriter.add
    monkeypatch.setattr(W.ShardedSafetensorsWriter, "add", boom)
    with pytest.raises(KeyboardInterrupt):
        C.megatron_to_hf(str(mc), str(work / "o_crash"), max_shard_gb=1e-5)
    _no_output(work, work / "o_crash")


def test_writer_shards_and_index(work):
    hf = _hf_dir(work, "qwen2_untied")
    mc = work / "mc_qwen2_untied"
    if not mc.exists():
        C.hf_to_megatron(str(hf), str(mc))
    out = work / "o_sharded"
    C.megatron_to_hf(str(mc), str(out), max_shard_gb=200e3 / 2**30)  # ~200 kB shards
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(idx["weight_map"].values()))
    assert len(files) >= 3 and all((out / f).is_file() for f in files)
    a, b = _tensors(hf), _tensors(out)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert idx["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in b.values())


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_saved_at_tp2_pp2_converts_to_same_hf(work, tp, pp):
    name = "qwen2_tied"
    hf = _hf_dir(work, name)
    mc = work / f"mc_{name}_{tp}{pp}"
    assert cli(["convert", "hf-to-megatron", "--hf", str(hf), "--out", str(mc), "--tp", str(tp),
                "--pp", str(pp)]) == 0
    meta = json.loads((mc / "m2po_convert.json").read_text())
    assert (meta["converted_at_tp"], meta["converted_at_pp"]) == (tp, pp)
    back = work / f"back_{name}_{tp}{pp}"
    C.megatron_to_hf(str(mc), str(back))
    a, b = _tensors(hf), _tensors(back)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(600)
def test_moe_converted_at_ep2_is_the_same_checkpoint(work, capsys):
    """Qwen3-MoE converted by 2 expert-parallel ranks (each writes its 2 of the 4 experts per layer): --verify
    passes and the way back gives the HF tensors bit for bit."""
    name = "qwen3_moe"
    hf = _hf_dir(work, name)
    mc, back = work / "mc_moe_ep2", work / "back_moe_ep2"
    assert cli(["convert", "hf-to-megatron", "--hf", str(hf), "--out", str(mc), "--ep", "2", "--verify"]) == 0
    assert "verify: max |logits_HF - logits_Megatron|" in capsys.readouterr().out
    assert json.loads((mc / "m2po_convert.json").read_text())["converted_at_ep"] == 2
    C.megatron_to_hf(str(mc), str(back))
    a, b = _tensors(hf), _tensors(back)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert sum(".mlp.experts." in k for k in a) == 2 * 4 * 3  # layers x experts x (gate, up, down)


def test_moe_ep_that_does_not_divide_the_experts_is_refused(work, capsys):
    hf = _hf_dir(work, "qwen3_moe")
    assert cli(["convert", "hf-to-megatron", "--hf", str(hf), "--out", str(work / "mc_moe_ep3"), "--ep", "3"]) == 2
    err = capsys.readouterr().err
    assert "num_experts = 4" in err and "expert_model_parallel_size = 3" in err
    assert not (work / "mc_moe_ep3").exists()


@pytest.mark.timeout(300)
def test_export_iterator_tp2_equals_hf(work, tmp_path):
    from mp import run_ranks

    name = "qwen3"
    hf = _hf_dir(work, name)
    bucket_mb = 0.05  # ~52 kB: several buckets, some tensors alone
    run_ranks(os.path.join(os.path.dirname(__file__), "export_worker.py"),
              ["2", "1", str(hf), str(tmp_path), str(bucket_mb)], 2, timeout=280)
    r0 = torch.load(tmp_path / "rank0.pt")
    r1 = torch.load(tmp_path / "rank1.pt")
    assert r1 == []  # TP rank 1 gathers but yields nothing
    ref = _tensors(hf)
    got = [(n, t) for b in r0 for n, t in b]
    assert sorted(n for n, _ in got) == sorted(ref)  # every HF tensor exactly once
    for n, t in got:
        assert torch.equal(t, ref[n]), n
    limit = bucket_mb * 2**20
    for b in r0:
        assert len(b) == 1 or sum(t.numel() * t.element_size() for _, t in b) <= limit
    assert len(r0) > 3


def test_streaming_writer_files_are_standard_safetensors(tmp_path):
    from safetensors.torch import load_file

    from m2po_megatron.convert.hf_writer import ShardedSafetensorsWriter

    a = torch.arange(6.0).reshape(2, 3).bfloat16()
    b = torch.tensor([1.5, -2.0, 3.25, 0.0])
    w = ShardedSafetensorsWriter(str(tmp_path), [("a", (2, 3), torch.bfloat16), ("b", (4,), torch.float32)], 16)
    with pytest.raises(ValueError, match="plan says"):
        w.add("a", torch.zeros(3, 2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out of plan"):
        w.add("b", b)
    w.add("a", a)
    w.add("b", b)  # 12 + 16 bytes > 16: a shard each
    w.close()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 28 and len(set(index["weight_map"].values())) == 2
    got = {}
    for f in set(index["weight_map"].values()):
        got.update(load_file(str(tmp_path / f)))
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b) and got["a"].dtype == torch.bfloat16
