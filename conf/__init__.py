# Hydra config tree, shipped inside the wheel and found as pkg://conf.
