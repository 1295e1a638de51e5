"""What every results file says about how it was produced: the commit and the command line.

The benchmarks put the repository root first on ``sys.path`` (so they measure this
checkout's tfremat, not an installed one) and start each results file with
:func:`header`, so a table can be traced to the code and the flags that printed it.
"""

from __future__ import annotations

import os
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


def kernels() -> str:
    """Which CPU kernels TensorFlow runs when it is already imported: oneDNN is on by default
    on x86 CPUs with AVX-512 and changes fusions, workspaces and float rounding, so a
    results file says which it measured; empty when TensorFlow is not imported."""
    if "tensorflow" not in sys.modules:
        return ""
    from tensorflow.python.util import _pywrap_util_port  # pylint: disable=import-outside-toplevel

    return f" TensorFlow {sys.modules['tensorflow'].__version__}, oneDNN {'on' if _pywrap_util_port.IsMklEnabled() else 'off'}."


def header(argv: list[str] | None = None) -> str:
    """One markdown line: the command, the commit it ran at and, for the benchmarks that
    run TensorFlow, its kernels (:func:`kernels`)."""
    return f"Command: `{command(argv)}` (commit {commit()}).{kernels()}"


def load_line() -> str:
    """One markdown line: the load averages when the run ended and the CPU count, against which
    a ratio measured on a shared machine is read."""
    return ("Load average over the last 1 / 5 / 15 minutes at the end: "
            + " / ".join(f"{load:.1f}" for load in os.getloadavg()) + f" on {os.cpu_count()} CPUs.")


def write_report(text: str, out: str | None) -> None:
    """Writes a results file's ``text`` to ``out`` (when given) and to standard output."""
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    sys.stdout.write(text + "\n")
