"""Step time with and without progress reporting: STEPS steps of a small
numpy matmul, each followed by the Kubeflow SDK's update_trainjob_status
(it throttles itself to one post per 5 s; without Trainer's env it returns
at once) and a touch of TRAINLET_HEARTBEAT_FILE when trainlet gives one.
Prints the mean step time."""

import os
import pathlib
import time

import numpy as np
from kubeflow.trainer import update_trainjob_status

steps = int(os.environ.get("STEPS", "12000"))
hb = os.environ.get("TRAINLET_HEARTBEAT_FILE")
a = np.random.default_rng(0).random((320, 320))
start = time.perf_counter()
for step in range(steps):
    a = np.tanh(a @ a.T / 320.0)
    update_trainjob_status(progress_percent=100 * step // steps, metrics={"step": step})
    if hb:
        pathlib.Path(hb).touch()
took = time.perf_counter() - start
print(f"STEP_MS={1000 * took / steps:.4f}", flush=True)
