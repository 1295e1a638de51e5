"""TensorFlow's profiler started and stopped without its log lines.

Extraction traces every profiled call (requested bytes, kernel times), and each start and
stop of TensorFlow's profiler logs five INFO lines from C++ ("Profiler session
initializing", "... started", "... collecting data", "... tear down", "Collecting XSpace to
repository"): 650-5,700 lines on a user's terminal before the first step of a
keras.applications model (benchmarks/results/user_check.md). TensorFlow reads
``TF_CPP_MIN_LOG_LEVEL`` once, when it is imported, so a library cannot raise it later;
:func:`profiler_trace` sends the process's standard error to a file while the profiler
starts and stops (no user code runs then) and passes on every line that is not that chatter.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile

import tensorflow as tf

__all__ = ["profiler_trace", "without_profiler_chatter"]

# The profiler's session log lines (TensorFlow 2.16-2.21), and the warnings TensorFlow 2.21
# logs for each option of a trace started with options (it ignores them: "host_tracer_level
# expects an i value").
_CHATTER = re.compile(r"\b(profiler_session|save_profile)\.cc:\d+\] |\bsession_manager\.cc:\d+\] \w+ expects an? \w+ value")


@contextlib.contextmanager
def without_profiler_chatter():
    """Standard error (file descriptor 2, C++ included) goes to a temporary file inside
    this context; on leaving, the lines that are not the profiler's session chatter are
    written back, in order. Where descriptor 2 cannot be duplicated, nothing is redirected."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().decode(errors="replace").splitlines(keepends=True)
                    if not _CHATTER.search(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


@contextlib.contextmanager
def profiler_trace(logdir: str, options=None):
    """TensorFlow's profiler records into ``logdir`` inside this context
    (``tf.profiler.experimental.start(logdir, options)`` and ``stop()``), quietly
    (:func:`without_profiler_chatter`)."""
    with without_profiler_chatter():
        tf.profiler.experimental.start(logdir, options=options)
    try:
        yield
    finally:
        with without_profiler_chatter():
            tf.profiler.experimental.stop()
