"""Where processes and tensors live: the device and collective backend, Ray placement of trainer ranks,
network helpers, and the reaper that reclaims a run's processes."""
