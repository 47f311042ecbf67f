"""One rank of the multi-process model tests: builds tiny HF models, loads them into Megatron at the requested
TP/PP layout, runs the same tokens through both and writes the max |logits diff| per model to OUT/rank{R}.json.

Usage (env RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set): python mp_worker.py [--ep=N] TP PP OUT name [name...]
(--ep: expert_model_parallel_size, for MoE models; every name must then be a MoE model)."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def forward_logits(model, ids, pos):
    """Full-vocab logits [b, s, V] on the last pipeline stage (None elsewhere)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def step(data_iter, m):
        batch = next(data_iter)
        return m(input_ids=batch[0], position_ids=batch[1], attention_mask=None), None

    b, s = ids.shape
    out = get_forward_backward_func()(forward_step_func=step, data_iterator=iter([(ids, pos)]), model=[model],
                                      num_microbatches=1, seq_length=s, micro_batch_size=b, forward_only=True)
    if not ps.is_pipeline_last_stage():
        return None
    logits = out[0]
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:  # parallel_output: each TP rank has a slice of the vocab
        parts = [torch.empty_like(logits) for _ in range(tp)]
        torch.distributed.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
        logits = torch.cat(parts, dim=-1)
    return logits


def main():
    args = sys.argv[1:]
    ep = int(args.pop(0).split("=", 1)[1]) if args[0].startswith("--ep=") else 1
    tp, pp, out_dir, *names = args
    torch.set_num_threads(1)
    from m2po_megatron import models
    from m2po_megatron.actor import parallel
    from tiny import make_hf_model, tiny_config

    parallel.init_distributed(tensor_model_parallel_size=int(tp), pipeline_model_parallel_size=int(pp),
                              expert_model_parallel_size=ep)
    results = {}
    for name in names:
        cfg = tiny_config(name)
        hf = make_hf_model(cfg, seed=1)
        tc = models.transformer_config_from_hf(cfg, pipeline_dtype=torch.float32)
        m = models.build_gpt_model(cfg, tc).eval()  # eval: megatron refuses MoE x TP in training without SP
        models.load_hf_weights(m, hf)
        gen = torch.Generator().manual_seed(7)
        ids = torch.randint(0, cfg["vocab_size"], (2, 24), generator=gen)
        pos = torch.arange(24).unsqueeze(0).expand(2, -1)
        with torch.no_grad():
            logits = forward_logits(m, ids, pos)
            if logits is not None:
                ref = hf(input_ids=ids).logits
                results[name] = float((logits - ref).abs().max())
        # The weight sync's export at this layout gives back the HF checkpoint's tensors (all ranks gather).
        from m2po_megatron.convert.export import gather_hf_state_dict
        from m2po_megatron.models.hf_checkpoint import on_disk_state_dict

        got, want = gather_hf_state_dict(m, cfg), on_disk_state_dict(hf)
        if cfg.get("tie_word_embeddings"):  # a checkpoint of a tied model has no lm_head.weight
            want.pop("lm_head.weight", None)
        results["export:" + name] = (float(max((got[k] - want[k]).abs().max() for k in want))
                                     if sorted(got) == sorted(want) else f"names differ: {sorted(set(got) ^ set(want))[:5]}")
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(results, f)
    parallel.destroy_distributed()


if __name__ == "__main__":
    main()
