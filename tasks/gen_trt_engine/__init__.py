"""gen_trt_engine stage: build a deployable engine from the newest model in results_dir."""
