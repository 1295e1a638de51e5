"""What every results file says about how it was produced: the commit and the command line.

The benchmarks put the repository root first on ``sys.path`` (so they measure this
checkout's tfremat, not an installed one) and start each results file with
:func:`header`, so a table can be traced to the code and the flags that printed it.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    """``git rev-parse --short HEAD``, with ``-dirty`` when tracked files differ from it
    (the numbers then come from uncommitted code); ``unknown`` outside a git checkout."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode != 0 or not head.stdout.strip():
        return "unknown"
    changes = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                             capture_output=True, text=True)
    return head.stdout.strip() + ("-dirty" if changes.stdout.strip() else "")


def command(argv: list[str] | None = None) -> str:
    """The command line as typed: ``python`` and the script path relative to the repository
    root, then every argument (``argv`` when a ``main(argv)`` was called with one)."""
    script = Path(sys.argv[0]).resolve()
    try:
        shown = str(script.relative_to(ROOT))
    except ValueError:
        shown = str(script)
    return shlex.join(["python", shown, *(sys.argv[1:] if argv is None else argv)])


def header(argv: list[str] | None = None) -> str:
    """One markdown line: the command and the commit it ran at."""
    return f"Command: `{command(argv)}` (commit {commit()})."
