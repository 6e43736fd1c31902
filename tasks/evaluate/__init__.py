"""evaluate stage: accuracy, agreement with float and latency of every model in results_dir."""
