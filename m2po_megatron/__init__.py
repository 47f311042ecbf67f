"""m2po-megatron: M2PO (second-moment trust policy optimization) for off-policy RL of LLMs on stale
rollouts, with a megatron-core actor, SGLang rollout servers and Ray placement."""

from m2po_megatron.infra.known_warnings import silence_known_warnings

__version__ = "0.1.0"

# Here, the one module every process imports before megatron: megatron-core's known noise (infra/known_warnings.py)
silence_known_warnings()
