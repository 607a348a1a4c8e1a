"""Job start for the XGBoost benchmark: join the collective from the DMLC_*
env and train 5 rounds on a small shard. With OWN_TRACKER=1, task 0 starts
the RabitTracker itself first, as Trainer's XGBoost examples do (the way
Trainer runs XGBoost today); under trainlet, trainlet runs it."""

import os

import numpy as np
import xgboost as xgb
from xgboost import collective
from xgboost.tracker import RabitTracker

task, world = int(os.environ["DMLC_TASK_ID"]), int(os.environ["DMLC_NUM_WORKER"])
tracker = None
if os.environ.get("OWN_TRACKER") == "1" and task == 0:
    tracker = RabitTracker(n_workers=world, host_ip="0.0.0.0", port=int(os.environ["DMLC_TRACKER_PORT"]), sortby="task")
    tracker.start()
args = {
    "dmlc_communicator": "rabit",
    "dmlc_tracker_uri": os.environ["DMLC_TRACKER_URI"],
    "dmlc_tracker_port": int(os.environ["DMLC_TRACKER_PORT"]),
    "dmlc_task_id": str(task),
}
rng = np.random.default_rng(task)
X = rng.random((256, 4))
with collective.CommunicatorContext(**args):
    xgb.train({"tree_method": "hist", "nthread": 1}, xgb.DMatrix(X, label=X.sum(axis=1)), num_boost_round=5)
if tracker is not None:
    tracker.wait_for()
