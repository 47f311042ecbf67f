"""Weight-sync names at real size, the trainer's side: for each paper recipe, the (name, shape) list its weight
sync sends, in the order it sends them, from the real export at the recipe's trainer layout. Run by the
PROJECT's python (megatron-core is not in the sglang environment); tests/contract/test_weight_names.py feeds the
lists to sglang's own load_weights.

    python tests/contract/trainer_export_names.py RECIPE.yaml...

Per recipe, each pipeline stage's model chunks are built by models.builder at TP rank 0 of the recipe's
tensor_model_parallel_size x pipeline_model_parallel_size on fake tensors in a fake process group
(convert.layout_check's stage builder), and convert.export.iter_hf_weight_buckets (what run.worker's
_sync_weights streams to DistributedWeightSync, with the recipe's rollout.bucket_mb) runs on it: its TP
all-gathers are answered by the fake world with tensors of the gathered shapes, so the names and whole shapes are
the export's own; stage 0's buckets first, then each later stage's (the order rank 0 relays them in). Prints one
JSON line: {recipe file name: {"hf_config", "tp", "pp", "rollout_tp", "buckets", "sent": [[name, shape], ...]}}."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def export_names(recipe: str) -> dict:
    from m2po_megatron.config import load_config
    from m2po_megatron.convert.export import iter_hf_weight_buckets
    from m2po_megatron.convert.layout_check import _build_stage
    from m2po_megatron.infra.fake_world import CollectiveLog, RehearsalMode, logged_collectives
    from m2po_megatron.models.hf_config import read_hf_config

    cfg = load_config(recipe, check_files=False)
    spec = read_hf_config(cfg.model.hf_config)
    tp, pp = int(cfg.parallel.tensor_model_parallel_size), int(cfg.parallel.pipeline_model_parallel_size)
    sent, buckets = [], 0
    for stage in range(pp):
        chunks = _build_stage(spec, tp, pp, stage)
        with RehearsalMode(), logged_collectives(CollectiveLog()):
            for bucket in iter_hf_weight_buckets(chunks, spec, bucket_mb=cfg.rollout.bucket_mb):
                sent += [[n, list(t.shape)] for n, t in bucket]
                buckets += 1
    return {"hf_config": str(cfg.model.hf_config), "tp": tp, "pp": pp, "rollout_tp": int(cfg.rollout.tp_size),
            "buckets": buckets, "sent": sent}


def main(argv: list[str]) -> int:
    print(json.dumps({Path(r).name: export_names(r) for r in argv}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
