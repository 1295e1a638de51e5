"""The speed of the link between the accelerator and host memory, measured (Beaumont et al.
2021, sec. 5.2: they measured 12 GB/s for PyTorch tensors on a V100).

The offloading strategies take the link's ``bandwidth`` in bytes per unit of the graph's
cost; profiled graphs count cost in seconds, so the measured bytes per second is what they
need there. On a machine without a GPU there is no link to measure: offloading is planned
and simulated with a bandwidth the user gives.
"""

from __future__ import annotations

import statistics
import time

import tensorflow as tf

from tfremat.errors import ArgumentError, is_int

__all__ = ["host_link_bandwidth"]


def host_link_bandwidth(size_bytes: int = 64 << 20, repeats: int = 5) -> float | None:
    """Bytes per second of a copy to host memory and back on the first GPU, the median of
    ``repeats`` round trips of ``size_bytes`` (both directions counted), after one warm-up
    round trip; None when TensorFlow sees no GPU.

    Raises:
        ArgumentError: ``size_bytes`` or ``repeats`` not an int >= 1 (``size_bytes`` at
            least 4, one float32).
    """
    for name, value, least in (("size_bytes", size_bytes, 4), ("repeats", repeats, 1)):
        if not is_int(value) or value < least:
            raise ArgumentError(f"{name} must be an int >= {least}, got {value!r}")
    gpus = tf.config.list_logical_devices("GPU")
    if not gpus:
        return None
    with tf.device(gpus[0].name):
        values = tf.random.uniform([size_bytes // 4], dtype=tf.float32)

    @tf.function
    def round_trip(tensor):
        with tf.device("/CPU:0"):
            host = tf.identity(tensor)
        with tf.device(gpus[0].name):
            back = tf.identity(host)
        return tf.reduce_sum(back[:1])

    round_trip(values).numpy()
    seconds = []
    for _ in range(repeats):
        began = time.perf_counter()
        round_trip(values).numpy()
        seconds.append(time.perf_counter() - began)
    return 2 * (size_bytes // 4) * 4 / statistics.median(seconds)
