"""autotune stage: Q/DQ placement chosen by measured latency (region mode)."""
