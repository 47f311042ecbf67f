"""The synthetic sums task and its tiny tokenizer (no model training here; see tests/eval for the warm-up)."""

import pytest

from m2po_megatron.demo.synthetic import SumSpec, generate_problems
from m2po_megatron.demo.tiny_tokenizer import build_tiny_tokenizer
from m2po_megatron.reward import math_verify_reward


def test_problems_are_seeded_distinct_and_verifiable():
    a = generate_problems(200, seed=3)
    assert a == generate_problems(200, seed=3)
    assert a != generate_problems(200, seed=4)
    assert len({r["problem"] for r in a}) == 200
    for r in a:
        terms = [int(t) for t in r["problem"].removeprefix("Compute ").removesuffix(".").split("+")]
        assert 2 <= len(terms) <= 3 and all(0 <= t <= 30 for t in terms)
        assert r["answer"] == str(sum(terms))
        assert math_verify_reward(r["solution"], r["answer"]) == 1.0  # the worked solution earns the reward
        assert set(r) >= {"id", "prompt", "answer", "source"} and r["prompt"].endswith("Put the answer in \\boxed{}.")


def test_exclusion_and_space():
    spec = SumSpec(2, 2, 3)  # 16 problems
    first = generate_problems(10, 0, spec, split="eval")
    rest = generate_problems(6, 0, spec, exclude={r["problem"] for r in first})
    assert not {r["problem"] for r in first} & {r["problem"] for r in rest}
    with pytest.raises(ValueError, match="distinct"):
        generate_problems(7, 0, spec, exclude={r["problem"] for r in first})
    with pytest.raises(ValueError, match="min_terms"):
        SumSpec(3, 2, 9)


def test_tiny_tokenizer_survives_autotokenizer_in_a_qwen2_model_dir(tmp_path):
    """transformers 5 rebuilds any tokenizer in a qwen2 model directory as Qwen2Tokenizer; ours must come back
    token-for-token identical."""
    from transformers import AutoTokenizer, Qwen2Config

    tok = build_tiny_tokenizer()
    tok.save_pretrained(tmp_path)
    Qwen2Config(vocab_size=384).save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    text = tok.apply_chat_template([{"role": "user", "content": "Compute 12+7+5. Put the answer in \\boxed{}."}],
                                   tokenize=False, add_generation_prompt=True) + "12+7=19 19+5=24 \\boxed{24}</s>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert again(text, add_special_tokens=False)["input_ids"] == ids
    assert again.decode(ids) == text  # exact round trip
    assert tok.convert_ids_to_tokens(ids).count("1") >= 2  # digits are single tokens
    assert "ĠPut" in tok.convert_ids_to_tokens(ids)  # prompt words are single tokens
    assert (again.bos_token, again.eos_token, again.pad_token, again.padding_side) == ("<s>", "</s>", "<pad>", "left")
    assert again.chat_template == tok.chat_template and len(tok) <= 384
