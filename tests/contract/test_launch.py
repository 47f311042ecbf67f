"""Every command line the launcher builds is one SGLang's own argument parser reads as meant, and the
launcher's flag check refuses what that parser refuses."""
import argparse
import warnings

import pytest

from m2po_megatron.rollout import protocol
from m2po_megatron.rollout.launcher import ServerSpec, build_command

pytestmark = pytest.mark.timeout(300)

SPECS = [
    ServerSpec(model_path="/models/Qwen3-8B-Base", engine="sglang"),
    ServerSpec(model_path="/models/Qwen3-8B-Base", engine="sglang", host="10.1.2.3", port=30001, tp_size=2,
               mem_fraction_static=0.85, context_length=16384, dtype="bfloat16", quantization="fp8",
               api_key="secret-key", random_seed=1235, max_running_requests=128, weight_version="0",
               enable_deterministic_inference=True, enable_return_routed_experts=True,
               extra_args=("--cuda-graph-backend-decode", "disabled", "--allow-auto-truncate",
                           "--attention-backend", "fa3", "--admin-api-key", "admin-key")),
    ServerSpec(model_path="Qwen/Qwen2.5-Math-7B", engine="sglang", skip_tokenizer_init=False, dtype="float32"),
]


def _sglang_parser():
    warnings.filterwarnings("ignore")
    from sglang.srt.server_args import ServerArgs

    p = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(p)
    return p


@pytest.mark.parametrize("i", range(len(SPECS)))
def test_launch_command_reads_as_meant(i):
    spec = SPECS[i]
    cmd = build_command(spec, python="python")
    assert cmd[:3] == ["python", "-m", "sglang.launch_server"]
    ns = _sglang_parser().parse_args(cmd[3:])
    assert (ns.model_path, ns.host, ns.port, ns.tp_size) == (spec.model_path, spec.host, spec.port, spec.tp_size)
    assert ns.skip_tokenizer_init is spec.skip_tokenizer_init
    assert ns.enable_deterministic_inference is spec.enable_deterministic_inference
    assert ns.enable_return_routed_experts is spec.enable_return_routed_experts
    assert ns.api_key == spec.api_key and ns.random_seed == spec.random_seed
    assert ns.context_length == spec.context_length and ns.quantization == spec.quantization
    assert ns.dtype == spec.dtype and ns.mem_fraction_static == spec.mem_fraction_static
    assert ns.weight_version == (spec.weight_version or "default")


def test_cpu_server_command_reads_alike_in_both_parsers(tiny_model_dir):
    """engine='local' gets the same flags: SGLang's parser and the CPU server's read them the same way, and
    SGLang resolves the command for the same model on CPU without complaint."""
    from sglang.srt.server_args import prepare_server_args

    from m2po_megatron.rollout.local_server import parser as local_parser

    spec = ServerSpec(model_path=tiny_model_dir, engine="local", port=30005, context_length=64, random_seed=3,
                      api_key="k", weight_version="0", enable_deterministic_inference=True,
                      enable_return_routed_experts=True,
                      extra_args=("--allow-auto-truncate",))
    argv = build_command(spec)[3:]
    ours, theirs = local_parser().parse_args(argv), _sglang_parser().parse_args(argv)
    for name in vars(ours):
        if name in vars(theirs) and name not in ("dtype",):
            assert getattr(ours, name) == getattr(theirs, name), name
    resolved = prepare_server_args(argv + ["--device", "cpu"])
    assert resolved.enable_deterministic_inference and resolved.allow_auto_truncate


ARGV = [  # (extra_args, note): the launcher accepts exactly what SGLang's parser accepts
    ["--allow-auto-truncate"], ["--cuda-graph-backend-decode", "disabled"], ["--admin-api-key", "k"],
    ["--attention-backend", "fa3"], ["--attention-backend", "fa9"], ["--tp-size", "2"], ["--tp-size", "two"],
    ["--tp-size"], ["--mem-fraction-static=0.7"], ["--mem-fraction-static", "x"], ["--no-such-flag"],
    ["--enable-deterministic-inference", "--random-seed", "7"], ["--allow-auto-truncate=yes"],
    ["--quantization", "fp8"], ["--quantization", "fp9"], ["--chunked-prefill-size", "4096"],
    ["--tensor-parallel-size", "2"], ["--log-level", "debug"], ["--tp-size", "2", "3"],
    ["--enable-return-routed-experts"], ["--enable-return-routed-experts", "true"],
]


@pytest.mark.parametrize("argv", ARGV, ids=lambda a: " ".join(a))
def test_flag_check_agrees_with_sglangs_parser(argv):
    try:
        _sglang_parser().parse_args(["--model-path", "/m", *argv])
        real = True
    except (argparse.ArgumentError, SystemExit):
        real = False
    try:
        protocol.check_launch_args(argv)
        ours = True
    except ValueError:
        ours = False
    assert ours == real, f"{argv}: SGLang's parser {'accepts' if real else 'refuses'} it, the launcher does not agree"


def test_deprecated_flags_are_refused_with_the_replacement():
    """Stricter than SGLang on purpose: it warns and goes on, the launcher names the replacement."""
    _sglang_parser().parse_args(["--model-path", "/m", "--disable-cuda-graph"])
    with pytest.raises(ValueError, match="cuda-graph-backend"):
        protocol.check_launch_args(["--disable-cuda-graph"])
