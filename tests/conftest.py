"""Test-wide environment: TensorFlow's allocator must count bytes (set before TF is imported)."""

import os

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
