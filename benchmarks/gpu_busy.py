"""The share of a time window GPU 0 was busy, for the benchmarks that time iterations on a GPU.

NVML's utilization counter (`nvmlDeviceGetUtilizationRates().gpu`) is the percentage of its last
sample period (1/6 s to 1 s, by GPU) during which at least one kernel ran on the device, from any
process: the resident workers' kernels count as the driver's do. A thread polls it every
`interval_s`; `share(t0, t1)` is the mean of the readings taken inside [t0, t1] (perf_counter
seconds), so windows of several sample periods (an iteration of seconds) read true and a window
shorter than one reads smeared by its neighbours.
"""

from __future__ import annotations

import threading
import time


class GpuBusy:
    """Polls GPU 0's utilization from a daemon thread until `stop()`."""

    def __init__(self, interval_s: float = 0.05):
        import pynvml  # nvidia-ml-py: installed with the CUDA torch wheels' NVIDIA packages, and by DeepSpeed

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self._interval_s = interval_s
        self._readings: list[tuple[float, float]] = []  # (perf_counter, busy fraction)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="gpu-busy", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._done.wait(self._interval_s):
            busy = self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu / 100.0
            self._readings.append((time.perf_counter(), busy))

    def share(self, t0: float, t1: float) -> float:
        """Mean busy fraction of the readings in [t0, t1]; NaN where there are none."""
        inside = [busy for t, busy in self._readings if t0 <= t <= t1]
        return sum(inside) / len(inside) if inside else float("nan")

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        self._nvml.nvmlShutdown()
