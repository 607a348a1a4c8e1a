"""Each gate row's record from target/bench-gate-runs.jsonl (one line per
gate run: {"ratios": {key: ratio}}): its runs, lowest, lowest halved, goal and
the floor they allow (the goal where every run met it, else the lowest
halved). With --write, benches/floors.toml takes `runs` and that `floor`
for every row measured (its `goal` and `source` are kept: review the source).

    python3 benches/floors.py LOADED.jsonl [--idle IDLE.jsonl] [--write]

Idle runs (floor_runs.sh --idle) join the record: some ratios are lower
idle than under load (a cold torchrun, the reference of several rows,
slows more under load than trainlet), and the floor is the lowest of all
runs halved (or the goal, where every run met it).
"""
import json
import math
import sys
import tomllib

FLOORS = "benches/floors.toml"


def floor_of(runs, goal):
    lowest = min(runs)
    if goal is not None and goal <= lowest:
        return goal
    scale = 100 if lowest >= 0.2 else 10000
    return math.floor(lowest / 2 * scale) / scale


def toml_str(s):
    return json.dumps(s, ensure_ascii=False)


def read_runs(path):
    runs = {}
    if path is None:
        return runs
    with open(path) as f:
        for line in f:
            for key, ratio in json.loads(line)["ratios"].items():
                # As floors.toml keeps it (4 significant digits): the floor
                # is computed from the runs as written, which the gate checks.
                runs.setdefault(key, []).append(float("%.4g" % ratio))
    return runs


def record(key, row, runs, idles):
    """A row's runs under load and idle: this file's measured ones, else the
    ones floors.toml holds."""
    return runs.get(key) or row.get("runs", []), idles.get(key) or row.get("idle", [])


def main():
    args = sys.argv[1:]
    write = "--write" in args
    idle_path = args[args.index("--idle") + 1] if "--idle" in args else None
    path = args[0]
    runs, idles = read_runs(path), read_runs(idle_path)
    with open(FLOORS, "rb") as f:
        floors = tomllib.load(f)
    for key in floors:
        r, i = record(key, floors[key], runs, idles)
        if not r:
            print("%-45s not measured" % key)
            continue
        goal = floors[key].get("goal")
        print("%-45s %2d runs under load, lowest %.3fx; %2d idle, lowest %s; goal %s -> floor %s (now %s)"
              % (key, len(r), min(r), len(i), "%.3fx" % min(i) if i else "-", goal, floor_of(r + i, goal),
                 floors[key].get("floor")))
    if not write:
        return
    with open(FLOORS) as f:
        header = "".join(line for line in f if line.startswith("#") or not line.strip())
        header = header.split("\n\n")[0] + "\n"
    out = [header]
    for key, row in floors.items():
        r, i = record(key, row, runs, idles)
        goal = row.get("goal")
        out.append("\n[%s]\n" % key)
        out.append("floor = %s\n" % (floor_of(r + i, goal) if r else row["floor"]))
        if goal is not None:
            out.append("goal = %s\n" % goal)
        out.append("runs = [%s]\n" % ", ".join("%.4g" % x for x in r))
        if i:
            out.append("idle = [%s]\n" % ", ".join("%.4g" % x for x in i))
        out.append("source = %s\n" % toml_str(row["source"]))
    with open(FLOORS, "w") as f:
        f.write("".join(out))
    print("wrote", FLOORS)


if __name__ == "__main__":
    main()
