"""Print, as JSON, what the runtime tests check in each ClusterTrainingRuntime:
one row per container of every replicated job, with its pod's termination
grace, its env, its preStop command, whether /tmp is a mounted volume, and
the exit codes its Job's podFailurePolicy names.

Usage: runtime_facts.py MANIFEST...
"""
import json
import sys

import yaml

rows = []
for path in sys.argv[1:]:
    with open(path) as f:
        for doc in yaml.safe_load_all(f):
            if not doc or doc.get("kind") != "ClusterTrainingRuntime":
                continue
            for rj in doc["spec"]["template"]["spec"]["replicatedJobs"]:
                job = rj["template"]["spec"]
                codes = []
                for rule in job.get("podFailurePolicy", {}).get("rules", []):
                    codes += rule.get("onExitCodes", {}).get("values", [])
                pod = job["template"]["spec"]
                volumes = {v["name"]: v for v in pod.get("volumes", [])}
                for c in pod["containers"]:
                    mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
                    rows.append({
                        "file": path,
                        "job": rj["name"],
                        "container": c["name"],
                        "image": c.get("image", ""),
                        "command": c.get("command", []),
                        "grace": pod.get("terminationGracePeriodSeconds", 30),
                        "env": {e["name"]: e.get("value") for e in c.get("env", []) if "value" in e},
                        "pre_stop": c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", []),
                        "tmp_volume": "emptyDir" in volumes.get(mounts.get("/tmp", ""), {}),
                        "exit_codes": codes,
                    })
json.dump(rows, sys.stdout)
