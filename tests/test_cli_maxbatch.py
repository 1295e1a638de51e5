"""``tfremat maxbatch``: the answer held on the device allocator, and printed so."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tfremat.budget import parse_budget


def _maxbatch(*flags, cwd):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run([sys.executable, "-m", "tfremat.cli", "maxbatch", *flags], capture_output=True, text=True,
                          timeout=600, cwd=cwd, env=env)


@pytest.fixture(scope="module")
def saved_convnet(tmp_path_factory):
    from tests.models import small_convnet

    folder = tmp_path_factory.mktemp("cli_maxbatch")
    path = folder / "tiny.keras"
    small_convnet(input_shape=(16, 16, 3), channels=4).save(path)
    return folder, path


def test_cli_maxbatch_prints_the_held_peak_and_skips_the_check_when_asked(saved_convnet):
    folder, path = saved_convnet
    # Above the 33 MiB a batch-1 step read with oneDNN off (TensorFlow's own convolution gradients).
    common = [f"--model={path}", "--budget=48MiB", "--strategies=checkpoint_all", "--cost_model=flops",
              "--max_batch=4096", "--nocache"]
    held = _maxbatch(*common, "--json", cwd=folder)
    assert held.returncode == 0, held.stderr[-2000:]
    row = json.loads(held.stdout.strip().splitlines()[-1])[0]
    assert row["allocator_peak_bytes"] <= parse_budget("48MiB")
    assert row["allocator_tried"][str(row["batch_size"])] is True
    assert "checkpoint_all on the allocator:" in held.stderr  # a progress line per batch run
    unchecked = _maxbatch(*common, "--noallocator_check", cwd=folder)
    assert unchecked.returncode == 0, unchecked.stderr[-2000:]
    assert "allocator_peak_bytes" not in unchecked.stdout and "--noallocator_check" in unchecked.stdout
    answer = int(unchecked.stdout.splitlines()[1].split()[1])
    assert row["batch_size"] <= answer == int(next(iter(row["allocator_tried"])))
