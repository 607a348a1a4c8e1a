"""Restart-gap probe: rank 0 crashes in the first run; every worker of the
restarted run records when its first instruction ran (wall clock, ns)."""
import time

t = time.time_ns()
import os  # noqa: E402

d = os.environ["GAP_DIR"]
rank = os.environ["RANK"]
if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    if rank == "0":
        time.sleep(1.0)
        with open(f"{d}/crash", "w") as f:
            f.write(str(time.time_ns()))
        os._exit(1)
    time.sleep(120)
else:
    with open(f"{d}/start_{rank}", "w") as f:
        f.write(str(t))
