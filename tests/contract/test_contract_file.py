"""The contract file in the project is what tools/gen_sglang_contract.py makes of the installed sglang."""
import importlib.metadata
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_contract_file_is_generated_from_the_installed_sglang():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import gen_sglang_contract
    finally:
        sys.path.pop(0)
    fresh = gen_sglang_contract.generate()
    on_disk = json.loads((ROOT / "m2po_megatron" / "contracts" / f"sglang-http-{fresh['sglang_version']}.json")
                         .read_text())
    assert on_disk == json.loads(json.dumps(fresh)), \
        "stale contract: run `python tools/gen_sglang_contract.py` in the make test-sglang environment"


def test_pins_agree():
    pins = dict(line.split("==") for line in (ROOT / "requirements" / "sglang-contract.txt").read_text().split()
                if "==" in line)
    assert importlib.metadata.version("sglang") == pins["sglang"]
    assert importlib.metadata.version("sglang-router") == pins["sglang-router"]
    from m2po_megatron.contracts import SGLANG_HTTP

    assert SGLANG_HTTP == f"sglang-http-{pins['sglang']}.json"
