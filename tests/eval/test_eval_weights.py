"""In-run evaluation counts the answers that came from other weights than the ones synced (a rollout server
restarted during the evaluation answers with its base weights), and says so beside the accuracy."""
from collections import Counter
from concurrent.futures import Future

from m2po_megatron.config import load_config
from m2po_megatron.demo.tiny_tokenizer import build_tiny_tokenizer
from m2po_megatron.eval import EvalSet
from m2po_megatron.eval.in_run import Evaluator
from m2po_megatron.eval.rollout_generate import rollout_generate_fn
from m2po_megatron.rollout.client import SampleResult


class TwoServers:
    """Stands in for the SyncRolloutClient: even prompts go to a server at `synced`, odd ones to a server that
    restarted (its answers carry version 0, the base weights')."""

    def __init__(self, tok, synced):
        self.tok, self.synced, self.k = tok, synced, 0

    def submit(self, prompt_ids, sampling_params, n=1, return_logprob=True):
        version = self.synced if self.k % 2 == 0 else 0
        self.k += 1
        ids = self.tok(r"\boxed{1}", add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        fut = Future()
        fut.set_result([SampleResult(output_ids=ids, output_logprobs=[], token_versions=[version] * len(ids),
                                     finish_reason="stop", prompt_tokens=len(prompt_ids), weight_version=version)
                        for _ in range(n)])
        return fut


def _rows(tok, n):
    return [{"id": f"s/{i}", "prompt": tok.apply_chat_template([{"role": "user", "content": f"Compute {i}+1."}],
                                                               tokenize=False, add_generation_prompt=True),
             "answer": str(i + 1)} for i in range(n)]


def test_answers_from_other_weights_are_counted_and_reported(tmp_path, capsys):
    tok = build_tiny_tokenizer()
    versions = Counter()
    gen = rollout_generate_fn(TwoServers(tok, 4), seed=0, versions=versions)
    assert len(gen([[1], [2], [3]], 2, 1.0, 1.0, 8)) == 3
    assert versions == {4: 4, 0: 2}  # prompts 0 and 2 at version 4, prompt 1 at 0; two samples each

    cfg = load_config(None, ["eval.n_samples=2"], check_files=False)
    sets = [EvalSet("sums", _rows(tok, 3), 2)]
    ev = Evaluator(cfg, TwoServers(tok, 4), tok, sets, tmp_path, None)
    m = ev(7, version=4)
    assert m["eval/answers_at_other_weights"] == 2 and "eval/avg/pass@1" in m
    out = capsys.readouterr().out
    assert "[m2po] eval at step 7: 2 answers came from other weights than version 4" in out, out

    m = Evaluator(cfg, TwoServers(tok, 0), tok, sets, tmp_path, None)(8, version=0)  # every server at 0
    assert m["eval/answers_at_other_weights"] == 0 and "other weights" not in capsys.readouterr().out
    assert "eval/answers_at_other_weights" not in Evaluator(cfg, TwoServers(tok, 4), tok, sets, tmp_path, None)(9)
