"""HF <-> Megatron model mapping: configs (hf_config, builder), the weight table (weights), reading HF
checkpoints (hf_checkpoint) and loading them into live Megatron models (loading).

Megatron is imported lazily inside functions, so importing this package is cheap."""
from m2po_megatron.models.builder import (build_gpt_model, build_model_chunks, layer_spec, te_available,
                                          transformer_config_from_hf, validate_fp8, validate_layout)
from m2po_megatron.models.hf_checkpoint import (CheckpointMismatchError, HFTensorSource, open_hf_source,
                                                validate_hf_source)
from m2po_megatron.models.hf_config import (HFModelSpec, UnsupportedModelError, load_hf_config_dict,
                                            read_hf_config)
from m2po_megatron.models.loading import global_named_parameters, load_hf_weights, unwrap

__all__ = ["HFModelSpec", "UnsupportedModelError", "CheckpointMismatchError", "HFTensorSource", "read_hf_config",
           "load_hf_config_dict", "transformer_config_from_hf", "build_gpt_model", "build_model_chunks",
           "layer_spec", "te_available", "validate_fp8", "validate_layout", "open_hf_source",
           "validate_hf_source", "load_hf_weights", "global_named_parameters", "unwrap"]
