"""Pipeline stages, one subpackage each; they meet only through artifacts in results_dir."""
