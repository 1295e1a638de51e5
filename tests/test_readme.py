"""The README's quick start runs as written."""

import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def quick_start() -> str:
    section = README.read_text().split("## Quick start", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_starts_with_the_two_commands():
    lines = README.read_text().splitlines()
    block = lines[lines.index("```") + 1: lines.index("```", lines.index("```") + 1)]
    assert [line.split()[:2] for line in block] == [["make", "demo"], ["make", "test"]]


def test_the_quick_start_runs_as_written(tmp_path):
    code = quick_start()
    assert "model = " in code and "tfremat.fit(" in code  # the example it shows defines its model
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**__import__("os").environ, "TFREMAT_CACHE_DIR": str(tmp_path / "cache")})
    assert run.returncode == 0, run.stderr[-3000:]
