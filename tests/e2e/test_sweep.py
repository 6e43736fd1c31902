"""Sweeps: the multirun summary (a failed job is a row, not the end of the sweep), the Optuna
sweeper over speed and accuracy, and jobs on a local Ray instance."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers import QUICK, run_tune


def _args(model: Path, rd: Path, extra: list[str], stages: str = "export,quantize,autotune") -> list[str]:
    return [f"stages=[{stages}]", "model=onnx", f"model.onnx_path={model}", "data=synthetic",
            f"results_dir={rd}", *QUICK, *extra]


@pytest.fixture
def tiny(residual_models) -> Path:
    return residual_models['sweep']


@pytest.mark.slow
def test_summary_lists_every_job_and_a_failed_one_with_its_reason(tiny, tmp_path):
    rd = tmp_path / "sweep"
    proc = run_tune(["-m", "autotune.schemes_per_region=2,4,8", *_args(tiny, rd, [])], cwd=tmp_path, check=True)
    sweep = rd / "multirun"
    for name in ("summary.md", "summary.json", "summary.png"):
        assert (sweep / name).stat().st_size > 0, name
    s = json.loads((sweep / "summary.json").read_text())
    assert sorted(r["label"] for r in s["jobs"]) == [f"autotune.schemes_per_region={n}" for n in (2, 4, 8)]
    assert all(r["status"] == "done" and r["speedup"] and r["measurements"] and r["tuning_seconds"] is not None
               for r in s["jobs"])
    assert s["best"] in {r["job"] for r in s["jobs"]} and s["pareto"]
    speeds = [r["speedup"] for r in s["jobs"]]
    assert speeds == sorted(speeds, reverse=True)
    md = (sweep / "summary.md").read_text()
    assert sum(ln.startswith("| ") and "| `autotune.schemes_per_region=" in ln for ln in md.splitlines()) == 3
    assert "★" in md
    assert re.search(r"tune .*autotune\.schemes_per_region=4", md) and "onnxruntime" in md  # reproduce line + versions
    assert "summary:" in proc.stdout

    # one job fails (a value the schema refuses): the others still run and the summary has its reason
    # (the jobs export only: the failure is the config's, before any stage)
    rd2 = tmp_path / "sweep2"
    proc = run_tune(["-m", "autotune.schemes_per_region=2,-4,8", *_args(tiny, rd2, [], "export")], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    s = json.loads((rd2 / "multirun" / "summary.json").read_text())
    rows = {r["label"]: r for r in s["jobs"]}
    assert rows["autotune.schemes_per_region=2"]["status"] == "done"
    assert rows["autotune.schemes_per_region=8"]["status"] == "done"
    bad = rows["autotune.schemes_per_region=-4"]
    assert bad["status"] == "failed" and "must be >= 1" in bad["reason"]
    assert "failed: autotune.schemes_per_region=-4: must be >= 1" in (rd2 / "multirun" / "summary.md").read_text()

    # re-running the sweep: every job is up to date, and the summary keeps their recorded numbers
    again = run_tune(["-m", "autotune.schemes_per_region=2,4,8", *_args(tiny, rd, [])], cwd=tmp_path, check=True)
    assert again.stderr.count("autotune: up to date, skipped") == 3
    s2 = json.loads((sweep / "summary.json").read_text())
    assert [r["speedup"] for r in s2["jobs"]] == speeds


def test_overlapping_cpu_timing_is_flagged_and_pareto_front():
    from pipeline.app.sweep import overlapping, pareto

    def row(job, host, start, end, speedup=1.0, drop=0.0, backend="onnxruntime"):
        return {"job": job, "host": host, "backend": backend, "timing_windows": [[start, end]], "speedup": speedup,
                "accuracy_drop": drop}

    rows = [row("a", "h1", 0, 10), row("b", "h1", 5, 15), row("c", "h2", 0, 10), row("d", "h1", 20, 30),
            row("e", "h1", 0, 10, backend="tensorrt")]
    assert overlapping(rows) == {"a", "b"}  # other host, later, or a GPU backend: comparable
    # the default backend (auto) and OpenVINO time on the CPU too
    for backend in ("auto", "openvino"):
        both = [row("a", "h1", 0, 10, backend=backend), row("b", "h1", 5, 15), row("c", "h1", 3, 4, backend="trtexec")]
        assert overlapping(both) == {"a", "b"}, backend
    pts = [row("fast", "h", 0, 1, 3.0, 2.0), row("exact", "h", 0, 1, 1.5, 0.0), row("worse", "h", 0, 1, 1.4, 0.5),
           row("mid", "h", 0, 1, 2.0, 1.0)]
    assert sorted(pareto(pts)) == ["exact", "fast", "mid"]


def test_reproduce_command_names_spec_file_overrides_and_job_folder():
    from pipeline.app.sweep import reproduce_command

    hc = {"job": {"config_name": "resnet50"},
          "runtime": {"output_dir": "/r/multirun/seed=1", "config_sources": [
              {"path": "hydra.conf", "schema": "pkg", "provider": "hydra"},
              {"path": "/repo/specs", "schema": "file", "provider": "main"}]},
          "overrides": {"task": ["seed=1", "results_dir=/r", "quantize.algorithm=entropy"]}}
    assert reproduce_command(hc) == ("tune --config-path /repo/specs --config-name resnet50 seed=1 "
                                     "quantize.algorithm=entropy results_dir=/r/multirun/seed=1")


@pytest.mark.slow
@pytest.mark.extra("the optuna extra (pip install -e '.[optuna]')")
def test_optuna_sweeper_searches_speed_and_accuracy(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper",
                        reason="needs the optuna extra: pip install -e '.[optuna]'")
    root = Path(__file__).resolve().parents[2]
    rd = tmp_path / "opt"
    proc = run_tune(["-m", "--config-path", str(root / "examples"), "--config-name", "optuna_digits",
                     "hydra.sweeper.n_trials=4", f"results_dir={rd}", "data.num_samples=64",
                     "quantize.calibration.batches=2", "autotune.accuracy.holdout_batches=2", "model.epochs=2",
                     "autotune.timing_runs=8", "autotune.warmup_runs=1", "progress=false"],
                    cwd=tmp_path, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((rd / "multirun" / "summary.json").read_text())
    assert len(s["jobs"]) == 4 and s["pareto"]
    assert all(r["status"] == "done" for r in s["jobs"])
    assert "Pareto front" in (rd / "multirun" / "summary.md").read_text()
    assert (rd / "multirun" / "optimization_results.yaml").exists()  # the sweeper's own report


@pytest.mark.slow
@pytest.mark.extra("the ray extra (pip install -e '.[ray]')")
def test_ray_launcher_runs_jobs_on_a_local_instance(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason="needs the ray extra: pip install -e '.[ray]'")
    rd = tmp_path / "ray"
    proc = run_tune(["-m", "hydra/launcher=ray", "seed=1,2", "stages=[export]", f"results_dir={rd}",
                     "model.epochs=1", "progress=false", "+hydra.launcher.ray.init.num_cpus=2",
                     "+hydra.launcher.ray.remote.num_cpus=1", "+hydra.launcher.ray.remote.num_gpus=0"],
                    cwd=tmp_path, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((rd / "multirun" / "summary.json").read_text())
    assert sorted(r["label"] for r in s["jobs"]) == ["seed=1", "seed=2"]
    assert all(r["status"] == "done" for r in s["jobs"])
    for r in s["jobs"]:
        assert (Path(r["dir"]) / "export" / "model.onnx").exists()


def test_multirun_with_cfg_is_a_one_line_error(tmp_path):
    proc = run_tune(["-m", "seed=1,2", "--cfg", "job"], cwd=tmp_path)
    assert proc.returncode == 2 and "-m and --cfg cannot be combined" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_missing_sweep_extra_is_named(monkeypatch, capsys):
    from pipeline.app import cli

    # a plugin whose parent namespace package is missing too is "not available", not an exception
    assert not cli.module_available("qdq_tune_no_such_parent.hydra_ray_launcher")

    real = cli.module_available
    monkeypatch.setattr(cli, "module_available", lambda name: False if "hydra_ray" in name else real(name))
    with pytest.raises(SystemExit) as exc:
        cli._check_plugins(["seed=1", "hydra/launcher=ray"])
    assert exc.value.code == 2
    assert "hydra/launcher=ray needs the ray extra: pip install 'qdq-tune[ray]'" in capsys.readouterr().err
