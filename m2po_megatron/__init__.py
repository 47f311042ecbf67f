"""m2po-megatron: M2PO (second-moment trust policy optimization) for off-policy RL of LLMs on stale
rollouts, with a megatron-core actor, SGLang rollout servers and Ray placement."""

__version__ = "0.1.0"
