"""The device-session tools under perf/ that decide what lands: run here on the CPU at tiny sizes so
that a broken tool is found before a device call is spent on it."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, timeout=600):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_tune_gdn_smoke(tmp_path):
    """perf/tune_gdn.py on the CPU: trial 0 is the heuristic default, every finished trial passed the
    output checks (normal and hostile inputs) before it was timed, and --store refuses a CPU run."""
    r = _run("perf/tune_gdn.py", "--smoke", "--trials", "3", "--budget-s", "300", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (g,) = json.loads((tmp_path / "tune_gdn.json").read_text())["groups"]
    assert g["key"] == "B1-K16-M8-V16"
    trials = g["trials"]
    assert trials[0]["trial"] == 0 and trials[0]["ok"] and trials[0]["config"] == g["default"]
    assert all(t["ok"] == bool(t["us"]) for t in trials) and g["best"]["total"] <= g["default_us"]
    r = _run("perf/tune_gdn.py", "--smoke", "--store")
    assert r.returncode != 0 and "needs a GPU run" in r.stderr


def test_pytest_shard_partitions_the_selection():
    """perf/pytest_shard.py: shards 1..n of a selection run every collected test exactly once."""
    sel = ["tests/gdn/test_gdn.py", "-k", "plan", "-q", "-p", "no:cacheprovider"]
    listing = _run("-m", "pytest", "--collect-only", "-q", *sel[:3], "-p", "no:cacheprovider")
    ids = [x for x in listing.stdout.splitlines() if "::" in x]
    assert len(ids) >= 3
    counts = []
    for i in (1, 2, 3):
        r = _run("perf/pytest_shard.py", f"{i}/3", *sel)
        assert r.returncode == 0, r.stdout[-2000:]
        head = next(x for x in r.stdout.splitlines() if x.startswith("shard"))
        counts.append(int(head.split(": ")[1].split(" of ")[0]))
        assert int(head.split(" of ")[1].split()[0]) == len(ids)
        assert f"{counts[-1]} passed" in r.stdout
    assert sum(counts) == len(ids)
    assert _run("perf/pytest_shard.py", "4/3", *sel).returncode != 0
