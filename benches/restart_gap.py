"""Restart-gap probe: every worker records when its first instruction ran
(wall clock, ns), in the first run (`first_RANK`) and in the restarted run
(`start_RANK`); rank 0 crashes in the first run after 1 s.

The first run is told apart by the crash file, not TORCHELASTIC_RESTART_COUNT:
torchrun's count is per agent and stays 0 on agents restarted for a
membership change (pytorch #135712)."""
import time

t = time.time_ns()
import os  # noqa: E402

d = os.environ["GAP_DIR"]
rank = os.environ["RANK"]
if not os.path.exists(f"{d}/crash"):
    with open(f"{d}/first_{rank}", "w") as f:
        f.write(str(t))
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
