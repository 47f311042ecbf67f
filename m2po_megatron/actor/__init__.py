"""megatron-core actor ranks: distributed setup (parallel.py), the CPU compatibility layer (cpu_compat.py, the
only module that knows Megatron may be running without a GPU; it only maps devices), and the training actor built on them.
Submodules import megatron lazily; importing this package is cheap."""
