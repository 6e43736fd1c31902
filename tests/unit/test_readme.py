"""The README's commands: every `tune` usage line composes and validates; the spec file examples work;
the Python API example runs as written; .ci/run runs the README's test command."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import run_tune, tune_in_process

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
    proc = tune_in_process([*args, "--cfg", "job"] if "--cfg" not in args else args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr


def _python_api() -> str:
    return README.split("## Python API", 1)[1].split("\n## ", 1)[0]


@pytest.mark.slow
def test_python_api_example_runs_as_written_and_twice_skips_every_stage(tmp_path):
    code = re.search(r"```python\n(.*?)```", _python_api(), re.S).group(1)
    code += "\nprint(dict(result.stages))\n"
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, proc.stderr
        *_, last, stages = proc.stdout.strip().splitlines()
        # the tuned model, or the exported float where auto found a runtime's float the fastest deployment
        assert re.fullmatch(r"\d+\.\d\dx speedup, .+, shipped \S+/(autotune/optimized_final|export/model)\.onnx",
                            last), last
        runs.append((last, eval(stages)))
    assert (tmp_path / "results" / "my_net" / "manifest.json").is_file()
    assert set(runs[0][1].values()) == {"done"} and set(runs[1][1].values()) == {"skipped"}, runs
    assert runs[0][0] == runs[1][0]  # the recorded result, not a new one


def test_python_api_spec_file_composes(tmp_path):
    section = _python_api()
    spec = re.search(r"```yaml\n# specs/my_net.yaml\n(.*?)```", section, re.S).group(1)
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "my_net.yaml").write_text(spec)
    (line,) = [ln.strip().split("  #")[0].strip() for ln in section.splitlines() if ln.startswith("    tune ")]
    proc = run_tune([*shlex.split(line)[1:], "--cfg", "job"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "_target_: my_project.nets.DigitsNet" in proc.stdout and "preset: quick" in proc.stdout


def _readme_commands() -> dict[str, str]:
    import runpy

    return runpy.run_path(str(ROOT / ".ci" / "readme_commands.py"))["commands"](README)


def test_ci_runs_the_readme_commands_verbatim_before_the_extras():
    cmds = _readme_commands()
    assert cmds["setup"].startswith("python3 -m venv .venv") and cmds["setup"].endswith("&& tune")
    assert cmds["test"] == "python -m pytest -q"
    # the section's prose introduces each line: the set-up first, then the test suite
    section = README.split("## The two commands", 1)[1].split("\n## ", 1)[0]
    assert section.index(cmds["setup"]) < section.index("Run the test suite:") < section.index(cmds["test"])
    ci = (ROOT / ".ci" / "run").read_text()
    lines = [ln.strip() for ln in ci.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    order = [lines.index(x) for x in ('setup="$(python3 .ci/readme_commands.py setup)"',
                                      'tests="$(python3 .ci/readme_commands.py test)"',
                                      'eval "$setup"', 'eval "$tests"')]
    assert order == sorted(order)
    # the extras come after the README's commands, and only the tests that need them run again
    assert lines.index('eval "$tests"') < min(i for i, ln in enumerate(lines) if "[optuna,ray]" in ln)
    extra = lines.index("python -m pytest -q -m extra")
    assert extra > min(i for i, ln in enumerate(lines) if "[optuna,ray]" in ln)
    # after the tests only the CPU report (and, on a CPU with AMX, the peer bench, which never fails the run)
    assert not any("pytest" in ln for ln in lines[extra + 1:])
    assert any(ln.startswith("|| echo") for ln in lines[extra + 1:])


def test_every_extra_test_is_marked_and_says_what_to_install():
    """A test that needs an optional extra or qemu-user carries the `extra` marker (CI runs it again
    after installing them) and skips naming what to install."""
    from tests import helpers

    needs_extra = ("hydra_plugins.", f"{helpers.qemu_haswell.__name__}()")  # renaming the helper renames this
    checked = []
    for path in (ROOT / "tests").rglob("test_*.py"):
        if path.name == "test_readme.py":
            continue
        text = path.read_text()
        for m in re.finditer(r"\ndef (test_\w+)\(.*?(?=\n(?:@|def |class )|\Z)", text, re.S):
            body = m.group(0)
            if any(s in body for s in needs_extra):
                before = text[:m.start() + 1].rstrip().splitlines()[-3:]
                # marked, naming what it needs (the plain command's skip reason says it)
                assert any(ln.startswith("@pytest.mark.extra(") for ln in before), \
                    f"{path.name}::{m.group(1)} lacks @pytest.mark.extra(need)"
                assert re.search(r"pip install|apt-get install", body), f"{path.name}::{m.group(1)}"
                checked.append(m.group(1))
    # the optuna and ray sweeps and the emulated-CPU accuracy tests: a scan that finds none checks nothing
    assert len(checked) >= 4, checked


def _section(title: str) -> str:
    return README.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def test_accuracy_as_you_define_it_examples_compose_and_the_metric_runs(tmp_path, monkeypatch):
    """The custom metric as written scores outputs; both spec files compose through the CLI."""
    import numpy as np

    from tests import models

    section = _section("Accuracy as you define it")
    code = re.search(r"```python\n# my_metrics.py\n(.*?)```", section, re.S).group(1)
    (tmp_path / "my_metrics.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    ns: dict = {}
    exec(code, ns)  # noqa: S102 - the README's own example
    logits = np.eye(4, dtype=np.float32)[[0, 1, 2, 3]]
    assert ns["top1"]([{"logits": logits}], [{"logits": logits}], [np.array([0, 1, 2, 0])]) == 75.0
    (tmp_path / "specs").mkdir()
    models.save(models.conv_chain(), tmp_path, "minilm")
    (tmp_path / "feeds").mkdir()
    for name in ("minilm", "digits_top1"):
        spec = re.search(rf"```yaml\n# specs/{name}.yaml\n(.*?)```", section, re.S).group(1)
        (tmp_path / "specs" / f"{name}.yaml").write_text(spec)
        proc = tune_in_process(["--config-path", "specs", "--config-name", name, "--cfg", "job"], cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
    assert "custom_metric: my_metrics.top1" in proc.stdout
