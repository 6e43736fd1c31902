"""PatternCache: the best schemes per pattern, kept across runs to warm-start similar models.

Entries of one pattern stay at least ``minimum_distance`` points apart (a near-duplicate keeps only
the faster of the two) and at most ``max_entries_per_pattern`` per pattern, fastest first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipeline.artifacts import atomic_write_text
from pipeline.errors import StateError, first_line
from tasks.autotune.region.scheme import InsertionScheme
from tasks.autotune.state_file import PATTERN_CACHE, StateDocument, StateHeader, read_state

# the file's format; it holds schemes of any model, so its header names none
HEADER = StateHeader.of(1, None, None)


@dataclass
class CacheEntry:
    scheme: InsertionScheme
    ratio: float  # latency relative to the float baseline it was measured against

    def to_dict(self) -> dict[str, Any]:
        return {"scheme": self.scheme.key, "ratio": round(self.ratio, 6)}


@dataclass
class PatternCache:
    minimum_distance: int = 4
    max_entries_per_pattern: int = 32
    entries: dict[str, list[CacheEntry]] = field(default_factory=dict)

    @property
    def num_patterns(self) -> int:
        return len(self.entries)

    def schemes_for(self, pattern: str) -> list[InsertionScheme]:
        return [e.scheme for e in self.entries.get(pattern, [])]

    def add(self, pattern: str, scheme: InsertionScheme, ratio: float) -> bool:
        """Add a measured scheme; returns whether the cache changed."""
        items = self.entries.setdefault(pattern, [])
        for i, e in enumerate(items):
            if e.scheme.distance(scheme) < self.minimum_distance:
                if ratio < e.ratio:
                    items[i] = CacheEntry(scheme, ratio)
                    items.sort(key=lambda x: x.ratio)
                    return True
                return False
        items.append(CacheEntry(scheme, ratio))
        items.sort(key=lambda x: x.ratio)
        del items[self.max_entries_per_pattern:]
        return True

    def to_dict(self) -> dict[str, Any]:
        return StateDocument(HEADER, {
            "pattern_cache_minimum_distance": self.minimum_distance,
            "pattern_cache_max_entries_per_pattern": self.max_entries_per_pattern,
            "patterns": {p: [e.to_dict() for e in items] for p, items in sorted(self.entries.items())},
        }).to_dict()

    def save(self, path: str | Path) -> None:
        atomic_write_text(path, yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def load(cls, path: str | Path, minimum_distance: int | None = None,
             max_entries_per_pattern: int | None = None) -> PatternCache:
        p = Path(path)
        if not p.exists():
            raise StateError(f"pattern cache {p} does not exist; check autotune.pattern_cache")
        doc = read_state(p, PATTERN_CACHE, HEADER, own=False, yaml_text=True).body
        try:
            patterns = doc["patterns"]
            cache = cls(int(minimum_distance if minimum_distance is not None else doc.get("pattern_cache_minimum_distance", 4)),
                        int(max_entries_per_pattern if max_entries_per_pattern is not None
                            else doc.get("pattern_cache_max_entries_per_pattern", 32)))
            for pattern, items in (patterns or {}).items():
                for item in items:
                    cache.add(str(pattern), InsertionScheme.from_keys(item["scheme"]), float(item["ratio"]))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PATTERN_CACHE.corrupt(p, f"{type(exc).__name__}: {first_line(exc)}") from None
        return cache
