"""Rollout engines: SGLang (GPU) or our CPU server speaking the same HTTP protocol, the client, the launcher
and the trainer side of weight sync. Heavy imports (torch, aiohttp, ray) stay inside the submodules."""
from m2po_megatron.rollout.client import (ClientStats, RolloutClient, RolloutFailed, RolloutRequestError,
                                          SampleResult, SyncRolloutClient)
from m2po_megatron.rollout.launcher import EngineManager, ServerSpec, ServerStartError
from m2po_megatron.rollout.weight_sync import DistributedWeightSync

__all__ = ["ClientStats", "DistributedWeightSync", "EngineManager", "RolloutClient", "RolloutFailed",
           "RolloutRequestError", "SampleResult", "ServerSpec", "ServerStartError", "SyncRolloutClient"]
