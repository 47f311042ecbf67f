"""The paper recipes' requests fit SGLang: every training and eval body built from each recipe, for a prompt
of data.max_prompt_len tokens, passes SGLang's HTTP layer launched with that recipe's model config and
rollout.context_length, and SGLang's scheduler would let it generate its full max_new_tokens."""
import pathlib

import pytest

from m2po_megatron.rollout import protocol
from m2po_megatron.rollout.client import build_generate_body

pytestmark = pytest.mark.timeout(600)
ROOT = pathlib.Path(__file__).resolve().parents[2]
RECIPES = sorted(p.name for p in (ROOT / "recipes" / "paper").glob("*.yaml") if p.name != "base.yaml")


@pytest.mark.parametrize("name", RECIPES)
def test_paper_recipe_requests_fit_sglang(name):
    from m2po_megatron.config import load_config
    from m2po_megatron.agents.runner import sampling_params
    from tests.contract.sglang_http import SGLangHTTP

    cfg = load_config(ROOT / "recipes" / "paper" / name, check_files=False)
    model_dir = str((ROOT / cfg.model.hf_config).parent)  # a config.json is all a --skip-tokenizer-init launch reads
    http = SGLangHTTP(model_dir, cfg.rollout.context_length)
    prompt = [11] * cfg.data.max_prompt_len
    e = cfg.eval
    bodies = [build_generate_body(prompt, dict(sampling_params(cfg), sampling_seed=2**31 - 1), "train"),
              build_generate_body(prompt, {"temperature": e.temperature, "top_p": e.top_p, "sampling_seed": 0,
                                           "max_new_tokens": e.max_new_tokens or cfg.rollout.max_new_tokens},
                                  "eval", return_logprob=False)]
    for body in bodies:
        status, text = http.request("POST", "/generate", body)
        assert status == 200, f"{name}: SGLang refuses {body['rid']} requests: {text[:400]}"
        want = body["sampling_params"]["max_new_tokens"]
        _, kept = protocol.check_lengths(len(prompt), want, want, http.tm.context_len)
        assert kept == want, f"{name}: SGLang's scheduler would stop {body['rid']} samples at {kept} tokens"
