"""Print one of the README's two commands (`setup` or `test`) exactly as the README writes them.

.ci/run runs what this prints, so CI runs the commands a new user types; tests/unit/test_readme.py
checks that .ci/run uses it for both.
"""

from __future__ import annotations

import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def commands(text: str) -> dict[str, str]:
    """The indented command lines of the README's "The two commands" section, by role."""
    section = text.split("## The two commands", 1)[1].split("\n## ", 1)[0]
    lines = [ln.strip() for ln in section.splitlines() if ln.startswith("    ") and ln.strip()]
    if len(lines) != 2:
        raise SystemExit(f"README.md: 'The two commands' should hold 2 indented command lines, found {len(lines)}")
    return {"setup": lines[0], "test": lines[1]}


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("setup", "test"):
        raise SystemExit("usage: readme_commands.py setup|test")
    print(commands(README.read_text())[sys.argv[1]])
