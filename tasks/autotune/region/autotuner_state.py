"""The region search's resumable state, ``autotuner_state.yaml``: every pattern's measured schemes,
saved after each measurement so a killed run resumes at the next unmeasured scheme."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from pipeline.artifacts import atomic_write_text
from pipeline.errors import first_line
from tasks.autotune.region.pattern_cache import PatternCache
from tasks.autotune.region.scheme import PatternSchemes
from tasks.autotune.state_file import REGION_STATE, StateDocument, StateHeader

STATE_VERSION = 1


class TunerState:
    """State save/load of QDQAutotunerBase (a mixin: it reads the autotuner's own fields)."""

    config: Any
    context: str | None
    baseline_latency_ms: float | None
    pattern_schemes: dict[str, PatternSchemes]
    pattern_cache: PatternCache | None
    _model_sha: str

    def state_header(self) -> StateHeader:
        """What a state file must have been made with for this search to resume from it."""
        return StateHeader.of(STATE_VERSION, self._model_sha, self.context,
                              quant_type=self.config.default_quant_type, placement=self.config.placement)

    def state_dict(self) -> dict[str, Any]:
        return StateDocument(self.state_header(), {
            "baseline_latency_ms": self.baseline_latency_ms,
            "patterns": {sig: ps.to_dict() for sig, ps in self.pattern_schemes.items()},
        }).to_dict()

    def save_state(self, path: str | Path) -> None:
        """Atomically write the state, and the pattern cache next to it (<stem>_pattern_cache.yaml)."""
        p = Path(path)
        atomic_write_text(p, yaml.safe_dump(self.state_dict(), sort_keys=False, width=200))
        if self.pattern_cache is not None:
            self.pattern_cache.save(p.with_name(f"{p.stem}_pattern_cache.yaml"))

    def load_state(self, path: str | Path) -> None:
        p = Path(path)
        try:
            doc = yaml.safe_load(p.read_text())
            if not isinstance(doc, dict) or "patterns" not in doc:
                raise ValueError("no 'patterns' table")
        except (yaml.YAMLError, ValueError, OSError) as exc:
            raise REGION_STATE.corrupt(p, first_line(exc)) from None
        body = StateDocument.resume(doc, p, REGION_STATE, self.state_header()).body
        self.baseline_latency_ms = body.get("baseline_latency_ms")
        try:
            for sig, d in body["patterns"].items():
                if sig in self.pattern_schemes:
                    loaded = PatternSchemes.from_dict(d)
                    loaded.candidates = self.pattern_schemes[sig].candidates
                    if loaded.baseline_scheme is None:
                        loaded.baseline_scheme = self.pattern_schemes[sig].baseline_scheme
                    self.pattern_schemes[sig] = loaded
                    best = loaded.find(loaded.best) if loaded.done and loaded.best is not None else None
                    if best is not None and best.ok and self.pattern_cache is not None:
                        # committed before the interruption: keep it in the cache saved next to the state
                        self.pattern_cache.add(sig, best.scheme, best.ratio)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise REGION_STATE.corrupt(p, f"{type(exc).__name__}: {first_line(exc)}", fix="delete it") from None
