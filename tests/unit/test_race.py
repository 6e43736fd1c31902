"""backend=auto's race after PTQ: a runtime whose best reachable latency (its best of PTQ and float over
what autotune can gain) stays over the tie margin of the leader is dropped; a close one is kept."""

from __future__ import annotations

from pipeline.app.race import (
    GAIN_BOUND,
    INT8_CEILING,
    TIE_MARGIN,
    Race,
    decide_race,
    describe,
    settled_floats,
    still_in_reach,
)


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
    # ONNX Runtime's fp32 float at 5x OpenVINO's bf16 float: even at the int8 ceiling it cannot catch up
    race = decide_race("k", {"onnxruntime": (27.0, None), "openvino": (5.0, None)}, INT8_CEILING)
    assert race.leader == "openvino" and race.entry("onnxruntime").dropped
    assert f"its float 27.000 ms / {INT8_CEILING}" in race.entry("onnxruntime").why
    assert "race before quantize: onnxruntime (float 27.000 ms; dropped" in describe(race, "before quantize")
    close = decide_race("k", {"onnxruntime": (1.7, None), "openvino": (0.5, None)}, INT8_CEILING)
    assert not close.entry("onnxruntime").dropped  # 1.7 / 4 = 0.425, within 1.03 x 0.5


def test_the_race_after_the_leaders_ptq_settles_floats_that_cannot_be_their_runtimes_best():
    """A float the race after the leader's PTQ showed slower than its own PTQ model (the leader's), or out of
    reach of the leader's best even over what autotune gains (another's), is not timed again after PTQ;
    one that could still be its runtime's best is."""
    # OpenVINO quantized first: PTQ 0.55 ms, float 0.70 ms; ONNX Runtime's float 1.9 ms (1.9 / 4.0 in reach)
    lead = decide_race("k", {"openvino": (0.70, 0.55), "onnxruntime": (1.9, None)}, INT8_CEILING)
    assert not lead.entry("onnxruntime").dropped
    assert settled_floats(lead) == {"openvino": 0.70, "onnxruntime": 1.9}  # 1.9 / 1.3 over 1.03 x 0.55
    # a float within the tie margin of its PTQ model, and another's float within reach, are timed again
    close = decide_race("k", {"openvino": (0.56, 0.55), "onnxruntime": (0.7, None)}, INT8_CEILING)
    assert settled_floats(close) == {}
    assert settled_floats(None) == {} and settled_floats(decide_race("k", {"openvino": (0.7, None)})) == {}


def test_the_race_after_the_leaders_ptq_scales_the_floats_the_race_before_quantize_timed(tmp_path):
    """The others' floats are not timed again after the leader's PTQ: their ratio to the leader's float in the
    race before quantize (one interleaved run) scales the leader's float there; none without that race."""
    from pipeline.app.race import FLOAT_RACE, float_ratios
    from pipeline.artifacts import atomic_write_json

    assert float_ratios(tmp_path, "openvino", ["onnxruntime"]) == {}
    (tmp_path / FLOAT_RACE).parent.mkdir(parents=True)
    race = decide_race("k", {"onnxruntime": (1.9, None), "openvino": (0.5, None)}, INT8_CEILING)
    atomic_write_json(tmp_path / FLOAT_RACE, race.to_dict())
    assert float_ratios(tmp_path, "openvino", ["onnxruntime", "tensorrt"]) == {"onnxruntime": 1.9 / 0.5}
    assert float_ratios(tmp_path, "tensorrt", ["onnxruntime"]) == {}  # the leader was not in it


def _rounds(*per_round_ms: list[float]) -> list[list[list[float]]]:
    """Blocks of deployments, one block of one run per round: each argument is a deployment's rounds."""
    return [[[ms] for ms in rounds] for rounds in per_round_ms]


def test_a_race_ends_once_every_runtime_is_clearly_in_or_out_of_reach():
    """``race_decided``: a runtime's latency is its best deployment's; once MIN_ROUNDS rounds are in, a
    runtime clearly within the bar is kept and one clearly beyond it out of reach; a runtime near the bar
    keeps the race going, and cheap rounds put a runtime out of reach only by more than LEVEL_SPREAD."""
    from pipeline.backends.ratios import CHEAP_SECONDS, LEVEL_SPREAD, MIN_ROUNDS, race_decided

    slow = 1000.0  # ms per round: rounds that are not cheap
    jitter = [1.0, 1.02, 0.99, 1.01, 1.0, 0.98, 1.02, 1.0]
    lead = [slow * j for j in jitter]
    bar = GAIN_BOUND * TIE_MARGIN

    def at(factor: float, n: int, base: list[float] = lead) -> list[float]:
        return [b * factor * (1.01 if i % 2 else 0.99) for i, b in enumerate(base[:n])]

    n = MIN_ROUNDS
    # runtime 0: float and PTQ (its best is the PTQ model); runtime 1 far behind, runtime 2 close
    assert not race_decided(_rounds(at(2, n - 1), lead[:n - 1], at(3, n - 1)), [[0, 1], [2]], bar)  # too few rounds
    assert race_decided(_rounds(at(2, n), lead[:n], at(3, n)), [[0, 1], [2]], bar)  # clearly out of reach
    assert race_decided(_rounds(at(2, n), lead[:n], at(1.1, n)), [[0, 1], [2]], bar)  # clearly kept
    # near the bar: undecided, whatever the rounds cost
    assert not race_decided(_rounds(at(2, 8), lead, at(bar, 8)), [[0, 1], [2]], bar)
    # cheap rounds (a 0.1 ms model): out of reach by 2x the bar is decided, by 1.2x the bar not yet
    fast = [ms / 1e4 for ms in lead]
    assert sum(fast) * 3 / 1000 < CHEAP_SECONDS
    assert race_decided(_rounds(at(2 * LEVEL_SPREAD * bar / 2, n, fast), fast[:n]), [[0], [1]], bar) is False
    assert race_decided(_rounds(at(1.1 * LEVEL_SPREAD * bar, n, fast), fast[:n]), [[0], [1]], bar)
    assert not race_decided(_rounds(at(1.2 * bar, n, fast), fast[:n]), [[0], [1]], bar)
    assert race_decided(_rounds(at(1.2 * bar, n), lead[:n]), [[0], [1]], bar)  # the same ratio, not cheap
    # a runtime whose every deployment dropped out is not waited for; one left alone is decided
    assert race_decided([[[1.0]] * n, [[1.0]] * (n - 1)], [[0], [1]], bar)


def test_a_race_of_timed_runtimes_stops_after_min_rounds_when_decided():
    """The plan auto's races time by (``TimingPlan.runtime_race``) ends a decided race after MIN_ROUNDS
    rounds and runs a close one to the end."""
    from pipeline.backends.ratios import MIN_ROUNDS
    from pipeline.backends.timing import RACE_ROUNDS, TimingPlan, time_interleaved

    class Fixed:
        def __init__(self, ms: float, swing: float = 0.01):
            self.ms, self.swing, self.n = ms, swing, 0

        def time_runs(self, n: int) -> list[float]:  # timed blocks (6 runs) swing in turn
            self.n += n >= 6
            return [self.ms * (1 + self.swing if self.n % 2 else 1 - self.swing)] * n

        def close(self) -> None:
            pass

    def rounds(*models: Fixed) -> int:
        plan = TimingPlan.runtime_race(48, 1, [[0, 1], [2]], GAIN_BOUND * TIE_MARGIN)
        blocks, errors = time_interleaved(list(models), plan)
        assert errors == [None] * len(models)
        return len(blocks[0])

    assert rounds(Fixed(400.0), Fixed(200.0), Fixed(900.0)) == MIN_ROUNDS  # out of reach: 4.5x the PTQ model
    assert rounds(Fixed(400.0), Fixed(200.0), Fixed(260.0)) == MIN_ROUNDS  # clearly within the bar of 1.34
    # 1.3x on average, 1.17x and 1.43x in turn: never clear of the bar
    assert rounds(Fixed(400.0), Fixed(200.0), Fixed(260.0, swing=0.1)) == RACE_ROUNDS


def test_the_final_choice_ends_once_the_pick_is_clear():
    """``choice_decided``: a runtime's float clearly slower than its shipped model leaves its autotune's
    pick standing; a float near it, or two runtimes' picks close together, keep the comparison going;
    cheap rounds need a lead of more than LEVEL_SPREAD; the reference float is not waited for."""
    from pipeline.backends.ratios import LEVEL_SPREAD, MIN_ROUNDS, choice_decided

    n = MIN_ROUNDS
    base = [1000.0, 1010.0, 995.0]

    def at(factor: float, scale: float = 1.0, swing: float = 0.01) -> list[float]:
        return [b * factor * scale * (1 + swing if i % 2 else 1 - swing) for i, b in enumerate(base[:n])]

    # one runtime: reference float (0), its float (1), its shipped model (2)
    assert not choice_decided(_rounds(at(3)[:n - 1], at(1.2)[:n - 1], at(1)[:n - 1]), [(1, 2)])  # too few rounds
    assert choice_decided(_rounds(at(3), at(1.2), at(1)), [(1, 2)])  # the float clearly slower
    assert choice_decided(_rounds(at(3), at(0.5), at(1)), [(1, 2)])  # the float clearly faster
    assert not choice_decided(_rounds(at(3), at(1.0, swing=0.1), at(1)), [(1, 2)])  # a near tie
    assert choice_decided(_rounds(at(0.1), at(1.0, swing=0.1), at(1)), [(1, 1)])  # its float is what ships
    # cheap rounds: a float faster by 1.2x does not displace the shipped model yet; slower, it is decided
    fast = 1e-4
    assert not choice_decided(_rounds(at(3, fast), at(1 / 1.2, fast), at(1, fast)), [(1, 2)])
    assert choice_decided(_rounds(at(3, fast), at(1 / (1.1 * LEVEL_SPREAD), fast), at(1, fast)), [(1, 2)])
    assert choice_decided(_rounds(at(3, fast), at(1.2, fast), at(1, fast)), [(1, 2)])
    # two runtimes (floats 1, 3; shipped 2, 4): picks 1.2x apart decide when not cheap, not when cheap
    assert choice_decided(_rounds(at(3), at(2), at(1), at(2.5), at(1.2)), [(1, 2), (3, 4)])
    assert not choice_decided(_rounds(at(3, fast), at(2, fast), at(1, fast), at(2.5, fast), at(1.2, fast)),
                              [(1, 2), (3, 4)])
    assert not choice_decided(_rounds(at(3), at(2), at(1), at(2.5), at(1.0, swing=0.1)), [(1, 2), (3, 4)])
