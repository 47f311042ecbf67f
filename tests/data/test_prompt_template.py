"""data.prompt_template and data.apply_chat_template in a run: the prompt a recipe names is the prompt the
model sees, in training and evaluation alike, and the chat template is applied exactly once."""

import json
from pathlib import Path

import pytest

from m2po_megatron.config import ConfigError, load_config
from m2po_megatron.run.inputs import load_data
from m2po_megatron.data.prepare import M2PO_TEMPLATE, prepare_rows
from m2po_megatron.data.rows import RowOptions, load_task_rows
from m2po_megatron.demo.tiny_tokenizer import build_tiny_tokenizer

ROWS = [{"id": "a/0", "prompt": "What is 1+1?", "answer": "2", "problem": "What is 1+1?"},
        {"id": "a/1", "prompt": "What is 2+3?", "answer": "5", "problem": "What is 2+3?"}]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def chat(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


def prompts(tmp_path, tok, rows, name="train.jsonl", **opts) -> list[str]:
    """The prompts a run renders from `rows` (the live path: data.rows.load_task_rows on a file)."""
    f = tmp_path / name
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [t.prompt for t in load_task_rows(str(f), RowOptions(**opts), tok)]


def test_the_template_is_rendered_from_the_problem_then_wrapped_once(tmp_path, tok):
    out = prompts(tmp_path, tok, ROWS, prompt_template="Q: {problem} A:", apply_chat_template=True)
    assert out == [chat(tok, "Q: What is 1+1? A:"), chat(tok, "Q: What is 2+3? A:")]
    assert out[0].count("<|user|>") == 1
    plain = prompts(tmp_path, tok, ROWS, prompt_template="m2po", apply_chat_template=False)
    assert plain[1] == M2PO_TEMPLATE.format(problem="What is 2+3?")
    as_is = prompts(tmp_path, tok, ROWS, apply_chat_template=False)
    assert as_is == ["What is 1+1?", "What is 2+3?"]


def test_prompts_prepared_with_a_chat_template_are_not_wrapped_twice(tmp_path, tok):
    rows, _ = prepare_rows([(1, {"problem": "What is 1+1?", "answer": "2"})], "s", template="plain",
                           tokenizer=tok, seed=None)
    assert rows[0]["chat_template"] is True and rows[0]["prompt"] == chat(tok, "What is 1+1?")
    with pytest.raises(ValueError, match="already carries the chat template.*apply_chat_template=false"):
        prompts(tmp_path, tok, rows, apply_chat_template=True)
    # Without the marker (an older file, or the tiny task's own rows) the chat prefix gives it away.
    unmarked = [{k: v for k, v in rows[0].items() if k != "chat_template"}]
    with pytest.raises(ValueError, match="train.jsonl:1"):
        prompts(tmp_path, tok, unmarked, apply_chat_template=True)
    # Either fix works: no second wrap, or a template re-rendered from the problem (wrapped once).
    assert prompts(tmp_path, tok, rows, apply_chat_template=False) == [chat(tok, "What is 1+1?")]
    again = prompts(tmp_path, tok, rows, prompt_template="plain", apply_chat_template=True)
    assert again == [chat(tok, "What is 1+1?")]


def test_a_template_needs_the_problem_field(tmp_path, tok):
    with pytest.raises(ValueError, match="d.jsonl:1.*problem.*prompt_template"):
        prompts(tmp_path, tok, [{"id": "q", "prompt": "p", "answer": "1"}], name="d.jsonl", prompt_template="plain",
                apply_chat_template=False)


def test_a_bad_template_fails_config_validation():
    with pytest.raises(ConfigError, match="data.prompt_template.*problem"):
        load_config("tiny-cpu", ["data.prompt_template=Solve {question}"], check_files=False)
    with pytest.raises(ConfigError, match="data.prompt_template"):
        load_config("tiny-cpu", ["data.prompt_template=no field"], check_files=False)


def test_the_run_feeds_training_and_evaluation_the_same_prompt(tmp_path, tok):
    for name in ("train", "eval"):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = load_config("tiny-cpu", [f"data.train_path={tmp_path / 'train.jsonl'}",
                                   f"data.eval_paths=[{tmp_path / 'eval.jsonl'}]",
                                   "data.prompt_template=m2po", "data.apply_chat_template=true",
                                   "data.max_prompt_len=1024",
                                   f"model.hf_path={tmp_path / 'no-model'}"],  # a built .cache/tiny-task's context is 128
                      check_files=False)
    prompts, eval_sets = load_data(cfg, tok)
    expected = {chat(tok, M2PO_TEMPLATE.format(problem=r["problem"])) for r in ROWS}
    assert {r.prompt for r in prompts.rows} == expected
    assert {r.prompt for r in eval_sets[0].rows} == expected
    # the tokens are the text's, and the rows keep every field as the file has it
    assert all(r.prompt_ids == tok(r.prompt, add_special_tokens=False)["input_ids"] for r in prompts.rows)
    assert sorted((r.row for r in eval_sets[0].rows), key=lambda r: r["id"]) == ROWS


PAPER = sorted(p for p in (Path(__file__).resolve().parents[2] / "recipes" / "paper").glob("*.yaml")
               if p.name != "base.yaml")


@pytest.mark.parametrize("recipe", PAPER, ids=[p.stem for p in PAPER])
def test_paper_recipes_resolve_to_the_papers_prompt_and_gspo_aggregation(recipe):
    from m2po_megatron.actor.options import actor_kwargs

    for algo, agg in (("m2po", "token-mean"), ("grpo", "token-mean"), ("grpo_notr", "token-mean"),
                      ("gspo", "seq-mean-token-mean")):
        cfg = load_config(recipe, [f"algo.name={algo}"], check_files=False)
        assert cfg.data.prompt_template == M2PO_TEMPLATE
        assert cfg.data.apply_chat_template is True
        assert cfg.algo.gspo.loss_agg_mode == "seq-mean-token-mean"
        assert actor_kwargs(cfg)["loss_kwargs"]["loss_agg_mode"] == agg, (recipe, algo)
        assert actor_kwargs(cfg)["loss_kwargs"].get("m2_tokens") == ("trust_region" if algo == "m2po" else None)
    cfg = load_config(recipe, ["algo.m2po.m2_tokens=all"], check_files=False)
    assert actor_kwargs(cfg)["loss_kwargs"]["m2_tokens"] == "all"  # AReaL's port's set, to the loss and the mask
