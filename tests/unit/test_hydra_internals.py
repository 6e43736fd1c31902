"""Hydra's private API is used in pipeline/app/hydra_internals.py only, and is where that module expects it:
a Hydra upgrade that moves any of it fails here, naming what moved, instead of in a user's `tune` run."""

from __future__ import annotations

from pathlib import Path

from pipeline.app import hydra_internals

ROOT = Path(__file__).resolve().parents[2]


def test_every_private_hydra_name_used_is_where_it_was():
    assert hydra_internals.missing() == [], (
        f"Hydra moved {hydra_internals.missing()}: update pipeline/app/hydra_internals.py for this Hydra")


def test_no_other_module_reaches_into_hydra_internals():
    users = [str(p.relative_to(ROOT)) for d in ("pipeline", "tasks") for p in (ROOT / d).rglob("*.py")
             if "hydra._internal" in p.read_text() and p.name != "hydra_internals.py"]
    assert users == []


def test_a_name_that_moved_is_reported(monkeypatch):
    monkeypatch.setattr(hydra_internals, "PRIVATE", (("hydra._internal.hydra", "NoSuchName", ()),
                                                     ("hydra._internal.hydra", "Hydra", ("no_such_method",))))
    assert hydra_internals.missing() == ["hydra._internal.hydra.NoSuchName", "hydra._internal.hydra.Hydra.no_such_method"]
