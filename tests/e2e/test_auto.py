"""backend=auto: each runtime quantized and tuned in its own results_dir, every shipped model timed side by
side, the fastest accurate one shipped and built; a runtime that cannot run is left out in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import QUICK, pin_backend, run_tune

# each runtime's own measurements kept short, as QUICK keeps the single-runtime ones
SHORT = [f"backend.{r}.{k}={v}" for r in ("onnxruntime", "openvino") for k, v in (("warmup_runs", 1),
                                                                                    ("timing_runs", 8))]


def test_auto_tunes_every_runtime_and_ships_the_fastest(residual_models, tmp_path):
    rd = tmp_path / "r"
    args = ["model=onnx", f"model.onnx_path={residual_models['tiny']}", "data=synthetic", "backend=auto",
            "backend.tune_all=true", *QUICK, *SHORT, "autotune.schemes_per_region=2", "evaluate.plot=false",
            f"results_dir={rd}"]
    proc = run_tune(args, cwd=tmp_path, check=True)
    choice = json.loads((rd / "autotune" / "runtime_choice.json").read_text())
    rows = {r["runtime"]: r for r in choice["rows"]}
    assert set(rows) == {"onnxruntime", "openvino"} and all(r["p10_ms"] for r in rows.values())
    assert choice["reference"] == "onnxruntime FP32 float"
    # the fastest of every runtime's shipped model and float, where a float not clearly faster than its own
    # runtime's shipped model ranks just behind it (rank_ms): its p10 may still be the lowest
    rank = [c["p10_ms"] if c.get("rank_ms") is None else c["rank_ms"] for c in choice["contenders"]]
    best = choice["contenders"][0]
    assert rank[0] == min(rank) and best["rank_ms"] is None  # the winner is never a held-back float
    fastest = best["runtime"]
    assert choice["winner"] == fastest
    stages = json.loads((rd / "manifest.json").read_text())["stages"]
    assert stages["autotune"]["metrics"]["headline"].startswith(f"ships {fastest} (")
    assert stages["autotune"]["metrics"]["headline"] == choice["headline"]
    # each runtime tuned in its own results_dir, on the shared export
    for name in rows:
        sub = json.loads((rd / "runtimes" / name / "manifest.json").read_text())["stages"]
        assert sub["autotune"]["status"] == "done"
        assert sub["autotune"]["metrics"]["runtime"]["file"]  # its own runtime settings were searched
    assert not (rd / "runtimes" / "onnxruntime" / "export").exists()
    # calibrated once: the second runtime's quantize reuses the first one's statistics
    assert proc.stderr.count("calibration statistics of") == 1 and "reused" in proc.stderr
    # the top level points at the winner's files; gen_trt_engine builds the winner's artifact
    assert stages["autotune"]["outputs"]["autotune/optimized_final.onnx"]["path"] == (
        f"runtimes/{fastest}/autotune/optimized_final.onnx" if best["what"] == "shipped" else "export/model.onnx")
    artifact = {"openvino": "model.xml", "onnxruntime": "model.ort.onnx"}[fastest]
    assert (rd / "gen_trt_engine" / artifact).exists()
    assert stages["evaluate"]["status"] == "done"
    # evaluate shows every runtime: the shipped one's own evaluation, the other's made in its results_dir
    metrics = json.loads((rd / "evaluate" / "metrics.json").read_text())
    evaluated = {r["runtime"]: r["evaluation"] for r in metrics["runtimes"]["rows"]}
    assert set(evaluated) == set(rows) and all(e["models"][0]["key"] == "float" for e in evaluated.values())
    other = next(n for n in rows if n != fastest)
    assert evaluated[other]["report"] == f"runtimes/{other}/evaluate/report.md"
    assert (rd / evaluated[other]["report"]).exists() and evaluated[fastest]["report"] == "evaluate/report.md"
    report = (rd / "evaluate" / "report.md").read_text()
    assert "## Every runtime" in report and f"| **{fastest}** |" in report and f"| {other} |" in report
    assert stages["evaluate"]["metrics"]["headline"].startswith(f"on {fastest}: ships ")
    assert f"auto: {choice['headline']}" in proc.stderr
    # the summary table's autotune row is auto's headline, not the winner's own run's
    assert any(ln.split()[:2] == ["autotune", "done"] and ln.endswith(choice["headline"])
               for ln in proc.stdout.splitlines()), proc.stdout
    # nothing changed: every stage skipped and the choice kept, not timed again
    again = run_tune(args, cwd=tmp_path, check=True)
    assert "(kept: nothing it compared changed)" in again.stderr
    assert "running" not in again.stderr
    # the Python API names the winner and loads what it ships, ready to run in that runtime's own API
    from pipeline.api import tune
    from pipeline.data.adapters import fixed_feeds
    from pipeline.graph.model import input_specs, load_model

    result = tune(pin_backend(args))  # as run_tune ran it
    assert result.runtime == fastest and set(result.stages.values()) == {"skipped"}
    feeds = fixed_feeds(input_specs(load_model(residual_models["tiny"])))
    deployed = result.load()
    outputs = deployed(feeds) if fastest == "openvino" else deployed.run(None, feeds)
    assert len(outputs) == 1


def test_auto_leaves_out_a_runtime_that_cannot_run_here_in_one_line(residual_models, tmp_path):
    import pytest

    from pipeline.backends import create_backend
    from pipeline.errors import BackendUnavailable
    from tests.helpers import compose

    try:
        create_backend(compose(["backend=tensorrt"]).backend)
        pytest.skip("TensorRT runs here: no runtime to leave out")
    except BackendUnavailable:
        pass
    rd = tmp_path / "r"
    args = ["model=onnx", f"model.onnx_path={residual_models['tiny']}", "data=synthetic", "backend=auto",
            "backend.runtimes=[tensorrt,onnxruntime]", *QUICK, *SHORT, "autotune.schemes_per_region=2",
            "stages=[export,quantize,autotune]", f"results_dir={rd}"]
    proc = run_tune(args, cwd=tmp_path, check=True)
    left = [ln for ln in proc.stderr.splitlines() if ln.startswith("WARNING: auto: tensorrt left out: ")]
    assert len(left) == 1, proc.stderr
    choice = json.loads((rd / "autotune" / "runtime_choice.json").read_text())
    assert choice["winner"] == "onnxruntime" and list(choice["left_out"]) == ["tensorrt"]
    assert "tensorrt left out" in choice["headline"]
    bad = run_tune([*args[:4], "backend.runtimes=[onnxruntime,nope]", *args[5:]], cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith(
        "tune: error: invalid config: backend.runtimes=['onnxruntime', 'nope']: give each runtime once")
    # a runtime's section renamed: one line naming its key, before export runs
    renamed = run_tune([*args[:4], "backend.onnxruntime.name=bogus", *args[5:-1], f"results_dir={tmp_path / 'n'}"],
                       cwd=tmp_path)
    assert renamed.returncode == 2 and renamed.stderr.strip().splitlines()[-1].startswith(
        "tune: error: invalid config: backend.onnxruntime.name=bogus: a runtime's section under backend=auto")
    assert not (tmp_path / "n" / "export").exists()


def test_auto_without_autotune_quantizes_every_runtime_and_evaluates_the_first(residual_models, tmp_path):
    rd = tmp_path / "r"
    args = ["model=onnx", f"model.onnx_path={residual_models['tiny']}", "data=synthetic", "backend=auto",
            "backend.tune_all=true", *QUICK, *SHORT, "stages=[export,quantize,evaluate]", "evaluate.plot=false",
            f"results_dir={rd}"]
    proc = run_tune(args, cwd=tmp_path, check=True)
    for name in ("onnxruntime", "openvino"):
        assert (rd / "runtimes" / name / "quantize" / "quantized_model.onnx").exists()
    assert "auto: no runtime chosen yet (autotune chooses one): the later stages run on onnxruntime" in proc.stderr
    stages = json.loads((rd / "manifest.json").read_text())["stages"]
    assert "ptq" in stages["evaluate"]["metrics"]["models"]  # the first runtime's PTQ model, beside float


def test_a_float_faster_than_every_shipped_model_ships_and_the_later_stages_run_it(residual_models, tmp_path,
                                                                                    monkeypatch):
    """Timings faked so that OpenVINO's float beats every shipped model: the top level ships the exported float
    with that float's settings, gen_trt_engine deploys it and evaluate and the API run it."""
    from pipeline.api import tune
    from pipeline.app import choice as auto_choice
    from pipeline.backends.base import Timing

    def timed(pairs, plan, name):
        def ms(backend, model):
            if model.name != "model.onnx":
                return 1.0  # a shipped model
            return 0.5 if backend.name == "openvino" else 2.0  # OpenVINO's float, the reference float
        times = [ms(b, Path(m)) for b, m in pairs]
        return ([Timing(median_ms=t, p10_ms=t, n=8, backend=name) for t in times],
                [[[t] for _ in range(plan.rounds)] for t in times])

    monkeypatch.setattr(auto_choice, "time_pairs", timed)
    rd = tmp_path / "r"
    args = ["model=onnx", f"model.onnx_path={residual_models['tiny']}", "data=synthetic", "backend=auto",
            "backend.tune_all=true", *QUICK, *SHORT, "autotune.schemes_per_region=1", "autotune.runtime.enabled=false",
            "evaluate.plot=false", "evaluate.max_batches=2", f"results_dir={rd}"]
    result = tune(args)
    choice = json.loads((rd / "autotune" / "runtime_choice.json").read_text())
    assert choice["winner"] == "openvino" and choice["contenders"][0]["what"] == "float", choice
    precision = choice["contenders"][0]["label"]
    assert choice["headline"].startswith(f"ships openvino ({precision}): 4.00x the onnxruntime FP32 float, 2.00x")
    stages = json.loads((rd / "manifest.json").read_text())["stages"]
    outputs = stages["autotune"]["outputs"]
    assert outputs["autotune/optimized_final.onnx"]["path"] == "export/model.onnx"
    assert (rd / "autotune" / "optimized_final.onnx").read_bytes() == (rd / "export" / "model.onnx").read_bytes()
    settings = json.loads((rd / outputs["autotune/openvino_compile.json"]["path"]).read_text())
    assert ("f32" in json.dumps(settings)) == precision.startswith("FP32")  # the float's precision ships with it
    assert settings["INFERENCE_PRECISION_HINT"] == {"FP32": "f32", "BF16": "bf16"}[precision.split()[0]]
    assert stages["autotune"]["metrics"]["shipped"] == "float"
    assert (rd / "gen_trt_engine" / "model.xml").exists()
    assert f"| **openvino** | {precision} (its " in (rd / "evaluate" / "report.md").read_text()
    metrics = json.loads((rd / "evaluate" / "metrics.json").read_text())
    assert metrics["shipped"] == "float" or "autotuned" not in metrics["models"], metrics.get("shipped")
    assert result.runtime == "openvino" and len(result.load()(fixed_feeds_of(residual_models["tiny"]))) == 1
    assert result.model == rd / "export" / "model.onnx" and result.speedup == 1.0  # the float, against itself


def fixed_feeds_of(path):
    from pipeline.data.adapters import fixed_feeds
    from pipeline.graph.model import input_specs, load_model

    return fixed_feeds(input_specs(load_model(path)))


def _assert_shipped_in_place(rd: Path, runtime: str, settings: str, gone: str) -> None:
    """What ships sits in results_dir/autotune/ whatever runtime won: its model and its settings file,
    the same files as the winner's own (another runtime's settings file gone)."""
    top, own = rd / "autotune", rd / "runtimes" / runtime / "autotune"
    assert (top / "optimized_final.onnx").read_bytes() == (own / "optimized_final.onnx").read_bytes()
    assert (top / settings).read_bytes() == (own / settings).read_bytes() and not (top / gone).exists()


def test_rechoose_on_another_host_ships_the_runtime_that_wins_there(residual_models, tmp_path, monkeypatch, capsys):
    """Timings faked so that OpenVINO wins where the run was tuned and ONNX Runtime on the host the
    results_dir lands on (another CPU kind, pinned through the test seam): `tune-rechoose` tunes nothing,
    judges both shipped models on the held-out samples here, ships ONNX Runtime, and gen_trt_engine,
    evaluate and result.load() use it; the manifest keeps both hosts' choices."""
    from pipeline.api import tune
    from pipeline.app import choice as auto_choice
    from pipeline.app.rechoose import main as rechoose
    from pipeline.quant.cpu import PIN_ENV, cpu_facts

    fast = {"runtime": "openvino"}
    timed = _fake_timings(lambda runtime, model: 2.0 if model == "model.onnx" else  # every float
                          0.5 if runtime == fast["runtime"] else 1.0)
    monkeypatch.setattr(auto_choice, "time_pairs", timed)
    rd = tmp_path / "r"
    args = [*_faked_auto_args(residual_models, rd), "backend.tune_all=true"]
    first = tune(args)
    assert first.runtime == "openvino" and (rd / "gen_trt_engine" / "model.xml").exists()
    _assert_shipped_in_place(rd, "openvino", "openvino_compile.json", "ort_session.json")
    here = cpu_facts().kind
    other = "avx2" if here != "avx2" else "amx"
    monkeypatch.setenv(PIN_ENV, {"avx2": "avx2", "amx": "avx2 avx512f avx512bw avx512_vnni amx_int8"}[other])
    fast["runtime"] = "onnxruntime"
    capsys.readouterr()
    assert rechoose([str(rd), "progress=false"]) == 0
    cost = capsys.readouterr().out.strip().splitlines()[-1]
    assert cost.startswith("tune-rechoose: chose again in ") and "spent quantizing and tuning" in cost
    assert cost.endswith(" s") and "gen_trt_engine and evaluate on this host then took" in cost
    stages = json.loads((rd / "manifest.json").read_text())["stages"]
    for name in ("onnxruntime", "openvino"):  # nothing was tuned again
        sub = json.loads((rd / "runtimes" / name / "manifest.json").read_text())["stages"]
        assert sub["autotune"]["metrics"]["checked_on"]["kind"] == here
    choices = stages["autotune"]["metrics"]["host_choices"]
    assert {k.split()[0]: v["winner"] for k, v in choices.items()} == {here: "openvino", other: "onnxruntime"}
    assert stages["autotune"]["outputs"]["autotune/optimized_final.onnx"]["path"].startswith("runtimes/onnxruntime/")
    assert (rd / "gen_trt_engine" / "model.ort.onnx").exists() and stages["gen_trt_engine"]["status"] == "done"
    assert stages["evaluate"]["metrics"]["headline"].startswith("on onnxruntime: ships ")
    from pipeline.api import host_warning

    assert host_warning(rd) is None  # judged here by tune-rechoose, and it met the budget
    _assert_shipped_in_place(rd, "onnxruntime", "ort_session.json", "openvino_compile.json")
    again = tune(args)  # the same host: everything up to date, the new choice stands
    assert set(again.stages.values()) == {"skipped"} and again.runtime == "onnxruntime"
    session = again.load()
    assert len(session.run(None, fixed_feeds_of(residual_models["tiny"]))) == 1
    # a re-choice tunes nothing: where tuning is not up to date (here another budget), it says so and stops
    capsys.readouterr()
    assert rechoose([str(rd), "progress=false", "accuracy.max_drop=2"]) == 2
    assert "a re-choice tunes nothing; run tune on the results_dir first" in capsys.readouterr().err
    # a key this version does not have, a value the validation refuses: one line naming it, no traceback, and
    # the results_dir's record of its overrides (which every later re-choice replays) untouched
    recorded = (rd / ".hydra" / "overrides.yaml").read_text()
    for bad in ("autotune.bogus=1", "backend.min_block_ms=-1"):
        assert rechoose([str(rd), bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and bad.split("=")[0] in err[0] and err[0].startswith("tune-rechoose: error: ")
        assert (rd / ".hydra" / "overrides.yaml").read_text() == recorded


def _faked_auto_args(residual_models, rd):
    """A quick backend=auto run of the tiny model whose timings a test fakes (no runtime search, a short
    evaluation)."""
    return ["model=onnx", f"model.onnx_path={residual_models['tiny']}", "data=synthetic", "backend=auto", *QUICK,
            *SHORT, "autotune.schemes_per_region=1", "autotune.runtime.enabled=false", "evaluate.plot=false",
            "evaluate.max_batches=2", f"results_dir={rd}"]


def _fake_timings(ms_of):
    """A stand-in for time_pairs: each (backend, model) timed at ``ms_of(backend name, model file name)``."""
    from pipeline.backends.base import Timing

    def timed(pairs, plan, name):
        times = [ms_of(b.name, Path(m).name) for b, m in pairs]
        return ([Timing(median_ms=t, p10_ms=t, n=8, backend=name) for t in times],
                [[[t] for _ in range(plan.rounds)] for t in times])
    return timed


def test_the_race_drops_a_runtime_far_behind_after_ptq_and_keeps_a_close_one(residual_models, tmp_path, monkeypatch):
    """Timings faked: OpenVINO's PTQ model 2x ONNX Runtime's is dropped before its autotune, named with its
    figures in the headline, the manifest and the report; at 1.2x it stays in the race and is tuned."""
    from pipeline.api import tune
    from pipeline.app import choice as auto_choice
    from pipeline.app import race

    ptq = {"onnxruntime": 1.0, "openvino": 2.0}
    floats = {"onnxruntime": 3.0, "openvino": 3.0}

    def ms(runtime, model):
        if model == "model.onnx":
            return floats[runtime]
        return ptq[runtime] if model == "quantized_model.onnx" else ptq[runtime] * 0.95  # a tuned model

    timed_models: list[list[str]] = []  # the models each race timed

    def timings(pairs, plan, name):
        timed_models.append([Path(m).name for _, m in pairs])
        return _fake_timings(ms)(pairs, plan, name)

    monkeypatch.setattr(race, "time_pairs", timings)
    monkeypatch.setattr(auto_choice, "time_pairs", _fake_timings(ms))
    rd = tmp_path / "far"
    args = _faked_auto_args(residual_models, rd)
    result = tune(args)
    assert result.runtime == "onnxruntime"
    sub = json.loads((rd / "runtimes" / "openvino" / "manifest.json").read_text())["stages"]
    assert sub["quantize"]["status"] == "done" and "autotune" not in sub  # dropped before its autotune
    # the floats the race after the leader's PTQ settled (both: 3.0 over 1.03 x 1.0, and over 1.3 x that)
    # are not timed again after PTQ: their figures there stand
    assert timed_models[-1] == ["quantized_model.onnx", "quantized_model.onnx"] and len(timed_models) == 3
    # after the leader's PTQ only its own deployments are timed: OpenVINO's float is scaled from the race
    # before quantize (its ratio to ONNX Runtime's float there)
    assert timed_models[1] == ["model.onnx", "quantized_model.onnx"]
    # quantized in the race, OpenVINO left the other kinds' verdicts (a run each) for its autotune
    from pipeline.accuracy.kinds import DEFERRED
    kinds = sub["quantize"]["metrics"]["checked_on"]["kinds"]
    assert any(k["how"] == DEFERRED for k in kinds) and all(k["verdict"] or k["how"] == DEFERRED for k in kinds)
    choice = json.loads((rd / "autotune" / "runtime_choice.json").read_text())
    why = choice["left_out"]["openvino"]
    assert why.startswith("not tuned: out of reach after PTQ (best reachable 1.538 ms") and "onnxruntime's 1.000 ms" in why
    assert "openvino left out (not tuned: out of reach" in choice["headline"]
    assert "openvino (PTQ 2.000 ms, float 3.000 ms; dropped" in choice["race"]
    stages = json.loads((rd / "manifest.json").read_text())["stages"]
    assert set(stages["quantize"]["seconds_by_runtime"]) == {"onnxruntime", "openvino"}  # every runtime's work
    assert stages["quantize"]["seconds"] >= max(stages["quantize"]["seconds_by_runtime"].values())
    for stage, races in (("quantize", ["float_race.json", "lead_race.json"]), ("autotune", ["race.json"])):
        # the races run within a stage count in its seconds, as each one recorded what its timing took
        raced = sum(json.loads((rd / "autotune" / r).read_text())["seconds"] for r in races if (rd / "autotune" / r).exists())
        assert stages[stage]["race_seconds"] == pytest.approx(raced, abs=2e-3)
        assert stages[stage]["seconds"] == pytest.approx(sum(stages[stage]["seconds_by_runtime"].values()) + raced,
                                                         abs=2e-3)
    report = (rd / "evaluate" / "report.md").read_text()
    assert "| openvino | left out | not tuned: out of reach after PTQ" in report and "race after PTQ" in report
    # chosen again on another kind of CPU: nothing is tuned, the runtime the race dropped stays untuned
    from pipeline.app.rechoose import main as rechoose
    from pipeline.quant.cpu import PIN_ENV, cpu_facts

    monkeypatch.setenv(PIN_ENV, "avx2" if cpu_facts().kind != "avx2" else "avx2 avx512f avx512bw avx512_vnni amx_int8")
    assert rechoose([str(rd), "progress=false"]) == 0
    assert "autotune" not in json.loads((rd / "runtimes" / "openvino" / "manifest.json").read_text())["stages"]
    again = json.loads((rd / "autotune" / "runtime_choice.json").read_text())
    assert again["winner"] == "onnxruntime" and again["left_out"]["openvino"].startswith("never tuned")
    monkeypatch.delenv(PIN_ENV)

    ptq["openvino"] = 1.2  # within reach: 1.2 / 1.3 < 1.03 x 1.0
    rd = tmp_path / "close"
    result = tune(_faked_auto_args(residual_models, rd))
    choice = json.loads((rd / "autotune" / "runtime_choice.json").read_text())
    assert {r["runtime"] for r in choice["rows"]} == {"onnxruntime", "openvino"} and not choice["left_out"]
    assert "openvino (PTQ 1.200 ms, float 3.000 ms; kept)" in choice["race"]
    tuned = json.loads((rd / "runtimes" / "openvino" / "manifest.json").read_text())["stages"]["autotune"]
    assert all(k["verdict"] for k in tuned["metrics"]["checked_on"]["kinds"])  # tuned: every kind judged

    ptq.update(onnxruntime=2.0, openvino=1.0)  # ONNX Runtime dropped: its FP32 float stays the reference
    rd = tmp_path / "ort_behind"
    tune(_faked_auto_args(residual_models, rd))
    choice = json.loads((rd / "autotune" / "runtime_choice.json").read_text())
    assert choice["winner"] == "openvino" and "onnxruntime" in choice["left_out"]
    assert choice["reference"] == "onnxruntime FP32 float"

    floats["onnxruntime"] = 6.0  # its float over 4.0 (the int8 ceiling) stays out of reach of OpenVINO's 1.0
    floats["openvino"] = 1.0
    rd = tmp_path / "float_behind"
    tune(_faked_auto_args(residual_models, rd))
    assert not (rd / "runtimes" / "onnxruntime" / "quantize").exists()  # not even quantized
    choice = json.loads((rd / "autotune" / "runtime_choice.json").read_text())
    assert choice["left_out"]["onnxruntime"].startswith("not quantized: out of reach before quantize")
    assert "race before quantize: onnxruntime (float 6.000 ms; dropped" in choice["race"]


def test_a_runtime_whose_float_cannot_reach_the_leaders_ptq_model_is_not_quantized(residual_models, tmp_path,
                                                                                     monkeypatch):
    """Timings faked: the fastest float (OpenVINO) quantizes first; ONNX Runtime's float over the int8 ceiling
    stays out of reach of OpenVINO's PTQ model, so it is not quantized, named in the choice and the race
    line; with its float closer it is quantized and races on."""
    from pipeline.api import tune
    from pipeline.app import choice as auto_choice
    from pipeline.app import race

    floats = {"onnxruntime": 4.0, "openvino": 2.0}  # 4.0 / 4 is within 1.03 x 2.0: kept before quantize

    def ms(runtime, model):
        return floats[runtime] if model == "model.onnx" else 0.5 if runtime == "openvino" else 0.45

    monkeypatch.setattr(race, "time_pairs", _fake_timings(ms))
    monkeypatch.setattr(auto_choice, "time_pairs", _fake_timings(ms))
    rd = tmp_path / "far"
    result = tune(_faked_auto_args(residual_models, rd))
    assert result.runtime == "openvino"
    assert not (rd / "runtimes" / "onnxruntime" / "quantize").exists()  # never quantized
    choice = json.loads((rd / "autotune" / "runtime_choice.json").read_text())
    why = choice["left_out"]["onnxruntime"]
    assert why.startswith("not quantized: out of reach of openvino's PTQ model (best reachable 1.000 ms"), why
    after_lead = choice["race"].split("race after the leader's PTQ: ")[1]
    assert "onnxruntime (float 4.000 ms; dropped" in after_lead
    assert "openvino (PTQ 0.500 ms, float 2.000 ms; leader)" in after_lead
    lead = json.loads((rd / "autotune" / "lead_race.json").read_text())
    assert lead["leader"] == "openvino" and [e["dropped"] for e in lead["entries"]].count(True) == 1

    floats["onnxruntime"] = 2.05  # 2.05 / 4 is within 1.03 x 0.5: quantized (the stages up to quantize suffice)
    rd = tmp_path / "close"
    tune([*_faked_auto_args(residual_models, rd), "stages=[export,quantize]"])
    assert (rd / "runtimes" / "onnxruntime" / "quantize" / "quantized_model.onnx").exists()
    # the run ends at quantize, so its PTQ model may ship: every CPU kind is judged, none left for autotune
    from pipeline.accuracy.kinds import DEFERRED
    sub = json.loads((rd / "runtimes" / "onnxruntime" / "manifest.json").read_text())["stages"]["quantize"]
    assert sub["metrics"]["checked_on"]["kinds"] and all(k["how"] != DEFERRED for k in sub["metrics"]["checked_on"]["kinds"])
    lead = json.loads((rd / "autotune" / "lead_race.json").read_text())
    kept = {e["runtime"]: e for e in lead["entries"]}["onnxruntime"]
    assert kept["float_ms"] == 2.05 and not kept["dropped"] and lead["leader"] == "openvino"
