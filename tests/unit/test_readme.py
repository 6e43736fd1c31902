"""The README's commands: every `tune` usage line composes and validates; the spec file example works;
.ci/run runs the README's test command."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest

from tests.conftest import run_tune

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _usage_lines() -> list[str]:
    block = README.split("## Usage", 1)[1].split("```", 1)[0]
    return [ln.strip().split("  #")[0].strip() for ln in block.splitlines() if ln.strip().startswith("tune ")]


@pytest.mark.parametrize("line", _usage_lines())
def test_usage_line_composes(line, tmp_path):
    args = shlex.split(line)[1:]
    if "--help" in args:
        assert run_tune(args, cwd=tmp_path).returncode == 0
        return
    if "--config-path" in args:
        spec = re.search(r"```yaml\n# specs/resnet50.yaml\n(.*?)```", README, re.S).group(1)
        (tmp_path / "specs").mkdir()
        (tmp_path / "specs" / "resnet50.yaml").write_text(spec)
    if any(a.startswith("model.onnx_path=") for a in args):
        from tests import models

        models.save(models.conv_chain(), tmp_path, "my")
    if "-m" in args:  # check the first job of a sweep
        args = [a for a in args if a != "-m"]
        args = [a.split(",")[0] if "=" in a else a for a in args]
    if "backend=tensorrt_rtx" in args:
        pytest.importorskip("tensorrt_rtx_bindings")
    if "backend=trtexec" in args and shutil.which("trtexec") is None:
        pytest.skip("trtexec is not on PATH (a missing backend is refused before the config is printed)")
    proc = run_tune([*args, "--cfg", "job"] if "--cfg" not in args else args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_ci_runs_the_readme_test_command():
    cmd = README.split("Run the test suite:", 1)[1].strip().splitlines()[0].strip()
    assert cmd in (ROOT / ".ci" / "run").read_text()
