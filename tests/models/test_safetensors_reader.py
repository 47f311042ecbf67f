"""The plain-read safetensors reader: same tensors as safetensors' own loader, clear errors on corrupt files."""
import pytest
import torch
from safetensors.torch import load_file, save_file

from m2po_megatron.models.hf_checkpoint import CheckpointMismatchError, SafetensorsFile


def test_reads_what_safetensors_wrote(tmp_path):
    tensors = {"w": torch.randn(5, 7).bfloat16(), "b": torch.randn(7), "i": torch.arange(4, dtype=torch.int64),
               "s": torch.tensor(3.5, dtype=torch.float16), "e": torch.empty(0, 3)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    f = SafetensorsFile(str(tmp_path / "m.safetensors"))
    ref = load_file(str(tmp_path / "m.safetensors"))
    assert sorted(f.keys()) == sorted(tensors)
    for k in tensors:
        got = f.get_tensor(k)
        assert got.dtype == ref[k].dtype and got.shape == ref[k].shape and torch.equal(got, ref[k]), k
    f.close()


def test_corrupt_and_truncated_files_fail_clearly(tmp_path):
    (tmp_path / "junk.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(CheckpointMismatchError, match="junk.safetensors is not a valid safetensors file"):
        SafetensorsFile(str(tmp_path / "junk.safetensors"))
    save_file({"w": torch.randn(64, 64)}, str(tmp_path / "t.safetensors"))
    data = (tmp_path / "t.safetensors").read_bytes()
    (tmp_path / "t.safetensors").write_bytes(data[:-100])
    with pytest.raises(CheckpointMismatchError, match="truncated while reading 'w'"):
        SafetensorsFile(str(tmp_path / "t.safetensors")).get_tensor("w")
