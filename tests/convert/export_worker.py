"""One rank of the export test: loads a tiny HF model into Megatron at TP2 and writes what
iter_hf_weight_buckets yields on this rank to OUT/rank{R}.pt. Usage: export_worker.py TP PP HF_DIR OUT BUCKET_MB"""
import os
import sys

import torch


def main():
    tp, pp, hf_dir, out, bucket_mb = sys.argv[1:]
    torch.set_num_threads(1)
    from m2po_megatron import models
    from m2po_megatron.actor import parallel
    from m2po_megatron.convert import iter_hf_weight_buckets

    parallel.init_distributed(tensor_model_parallel_size=int(tp), pipeline_model_parallel_size=int(pp))
    tc = models.transformer_config_from_hf(hf_dir, pipeline_dtype=torch.float32)
    m = models.build_gpt_model(hf_dir, tc)
    models.load_hf_weights(m, hf_dir)
    buckets = [[(n, t.clone()) for n, t in b] for b in iter_hf_weight_buckets([m], hf_dir, bucket_mb=float(bucket_mb))]
    torch.save(buckets, os.path.join(out, f"rank{os.environ['RANK']}.pt"))
    parallel.destroy_distributed()


if __name__ == "__main__":
    main()
