"""megatron-core integration: the MoELayer replacement, its gating conditions, and CPU compatibility."""
