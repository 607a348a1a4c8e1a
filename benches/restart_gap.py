"""Restart-gap probe: rank 0 crashes in the first run; every worker of the
restarted run records when its first instruction ran (wall clock, ns).

The first run is told apart by the crash file, not TORCHELASTIC_RESTART_COUNT:
torchrun's count is per agent and stays 0 on agents restarted for a
membership change (pytorch #135712)."""
import time

t = time.time_ns()
import os  # noqa: E402

d = os.environ["GAP_DIR"]
rank = os.environ["RANK"]
if not os.path.exists(f"{d}/crash"):
    if rank == "0":
        time.sleep(1.0)
        with open(f"{d}/crash.tmp", "w") as f:
            f.write(str(time.time_ns()))
        os.rename(f"{d}/crash.tmp", f"{d}/crash")
        os._exit(1)
    time.sleep(120)
else:
    with open(f"{d}/start_{rank}", "w") as f:
        f.write(str(t))
