"""Runs a test's script in a fresh Python process and reads what it found.

Settings fixed when TensorFlow starts (the inter-op thread count, oneDNN) need a process of
their own: the test suite's has one inter-op thread (:mod:`conftest`). The script prints
one line ``RESULT <json>``; a failed run fails the test with the end of its stderr.
"""

import json
import os
import subprocess
import sys


def run_script(path, source: str, *, timeout: float, default_threads: bool = True, **env) -> dict:
    """Writes ``source`` to ``path``, runs it with this interpreter and returns the JSON of
    its ``RESULT`` line. ``default_threads``: ``TF_NUM_INTEROP_THREADS`` removed from the
    environment (TensorFlow's default, as users run); ``env``: variables to set."""
    path.write_text(source)
    environment = dict(os.environ, **env)
    if default_threads:
        environment.pop("TF_NUM_INTEROP_THREADS", None)
    result = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=timeout,
                            env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, result.stdout[-2000:] + result.stderr[-2000:]
    return json.loads(lines[0].removeprefix("RESULT "))
