"""backend=auto's race after PTQ: a runtime whose best reachable latency (its best of PTQ and float over
what autotune can gain) stays over the tie margin of the leader is dropped; a close one is kept."""

from __future__ import annotations

from pipeline.app.race import GAIN_BOUND, TIE_MARGIN, Race, decide_race, describe, still_in_reach


def test_a_runtime_far_behind_after_ptq_is_dropped_and_a_close_one_kept():
    race = decide_race("k", {"onnxruntime": (3.0, 1.0), "openvino": (6.0, 2.0), "tensorrt": (3.0, 1.2)})
    assert race.leader == "onnxruntime"
    far, close = race.entry("openvino"), race.entry("tensorrt")
    assert far.dropped and not close.dropped and not race.entry("onnxruntime").dropped
    assert far.reachable_ms == 2.0 / GAIN_BOUND
    assert f"over {TIE_MARGIN} x onnxruntime's 1.000 ms" in far.why
    line = describe(race)
    assert "openvino (PTQ 2.000 ms, float 6.000 ms; dropped: best reachable" in line
    assert "tensorrt (PTQ 1.200 ms, float 3.000 ms; kept)" in line and "onnxruntime (" in line and "leader" in line
    assert Race.from_dict(race.to_dict()) == race


def test_a_float_faster_than_the_ptq_model_is_the_runtimes_best():
    # OpenVINO's bf16 float beats its own PTQ model and every other runtime: it leads
    race = decide_race("k", {"onnxruntime": (3.0, 1.6), "openvino": (0.9, 1.5)})
    assert race.leader == "openvino" and race.entry("openvino").best_ms == 0.9
    assert race.entry("onnxruntime").dropped  # 1.6 / 1.3 = 1.23 > 1.03 x 0.9


def test_the_leaders_tuned_latency_puts_a_kept_runtime_out_of_reach():
    race = decide_race("k", {"onnxruntime": (3.0, 1.0), "openvino": (3.0, 1.25)})
    assert not race.entry("openvino").dropped  # 1.25 / 1.3 = 0.96, within 1.03 x 1.0
    assert still_in_reach(race, "openvino", 1.0) == (True, "")
    reach, why = still_in_reach(race, "openvino", 1.2)  # the leader's autotune made it 1.2x faster: 0.833 ms
    assert not reach and "tuned 0.833 ms" in why


def test_an_untimed_runtime_is_kept():
    race = decide_race("k", {"onnxruntime": (3.0, 1.0), "openvino": (None, None)})
    assert not race.entry("openvino").dropped and "not timed" in race.entry("openvino").why


def test_before_quantize_a_float_out_of_reach_of_the_int8_ceiling_is_dropped():
    from pipeline.app.race import INT8_CEILING

    # ONNX Runtime's fp32 float at 5x OpenVINO's bf16 float: even at the int8 ceiling it cannot catch up
    race = decide_race("k", {"onnxruntime": (27.0, None), "openvino": (5.0, None)}, INT8_CEILING)
    assert race.leader == "openvino" and race.entry("onnxruntime").dropped
    assert f"its float 27.000 ms / {INT8_CEILING}" in race.entry("onnxruntime").why
    assert "race before quantize: onnxruntime (float 27.000 ms; dropped" in describe(race, "before quantize")
    close = decide_race("k", {"onnxruntime": (1.7, None), "openvino": (0.5, None)}, INT8_CEILING)
    assert not close.entry("onnxruntime").dropped  # 1.7 / 4 = 0.425, within 1.03 x 0.5
