"""The GPU-run tooling under perf/ (shard runner, summaries, shell scripts), tested on the CPU
at tiny sizes apart from the library, so that a broken tool is found before a device call is spent on it."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PERF = ROOT / "perf"


def _run(*args, timeout=600):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_pytest_shard_partitions_the_selection(tmp_path):
    """perf/pytest_shard.py: shards 1..n of a selection run every collected test exactly once, with the
    selection's options (-k here) kept."""
    (tmp_path / "test_many.py").write_text(
        "import pytest\n\n@pytest.mark.parametrize('i', range(7))\ndef test_a(i):\n    pass\n\n"
        "def test_b():\n    pass\n\ndef test_other():\n    pass\n")
    sel = ["test_many.py", "-k", "not other", "-q", "-p", "no:cacheprovider"]

    def shard(spec):
        env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # plugins' imports cost ~10 s a process here
        return subprocess.run([sys.executable, str(PERF / "pytest_shard.py"), spec, *sel], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300, env=env)

    counts = []
    for i in (1, 2, 3):
        r = shard(f"{i}/3")
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        head = next(x for x in r.stdout.splitlines() if x.startswith("shard"))
        counts.append(int(head.split(": ")[1].split(" of ")[0]))
        assert int(head.split(" of ")[1].split()[0]) == 8
        assert f"{counts[-1]} passed" in r.stdout
    assert counts == [3, 3, 2]
    assert shard("4/3").returncode != 0


def _row(op, variant, shape, M, us, baseline="cublas", status="ok"):
    ok = status == "ok"
    return {"op": op, "variant": variant, "shape": shape, "dims": {"M": M}, "status": status,
            "error": None if ok else "wrong (on purpose)", "median_us": us if ok else None,
            "speedup": (20.0 / us) if ok else None, "baseline": baseline, "tbs": 1.0}


def test_bench_summary(tmp_path):
    rows = [_row("linear", "cublas", "a-M1", 1, 20.0), _row("w12.matmul", "mma", "a-M1", 1, 10.0),
            _row("w12.matmul", "mma", "a-M4", 4, 40.0), _row("w12.matmul", "mma", "lm_head-M1", 1, 20.0),
            _row("w12.matmul", "tma", "a-M1", 1, 0, status="check_failed")]
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"meta": {"ok": 4, "failed": 1, "wall_s": 1.0, "gpu": "fake"}, "rows": rows}))
    r = _run("perf/bench_summary.py", str(path))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    # geomean of 2x, 0.5x and 1x = 1x; the baseline's own rows are not summarised
    want = r"w12\.matmul/mma: geomean 1\.000x over 3 shapes, min 0\.50x \(a-M4\) \| M1 1\.41\s+M4 0\.50"
    assert re.search(want, out), out
    assert "lm_head: 1.00x@1.00TB/s" in out and "linear/cublas" not in out
    assert "NOT REPORTED w12.matmul/tma a-M1: check_failed" in out
    assert "w12.matmul" not in _run("perf/bench_summary.py", str(path), "--op", "gdn").stdout


def test_ncu_summary(tmp_path):
    csv = tmp_path / "ncu.csv"
    head = '"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"\n'
    body = ['"0","w12_tma_kernel","SOL","Duration","us","12.5"',
            '"0","w12_tma_kernel","SOL","DRAM Throughput","%","80.1"',
            *(f'"0","w12_tma_kernel","","smsp__average_warps_issue_stalled_{r}_per_issue_active.ratio","","{v}"'
              for r, v in (("long_scoreboard", 3.2), ("barrier", 1.1)))]
    csv.write_text("==PROF== noise before the table\n" + head + "\n".join(body) + "\n")
    r = _run("perf/ncu_summary.py", str(csv))
    assert r.returncode == 0, r.stderr
    assert "[0] w12_tma_kernel: Duration=12.5 us; DRAM Throughput=80.1 %" in r.stdout
    assert "stalls: long_scoreboard 3.20, barrier 1.10" in r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("tool", sorted(p.name for p in PERF.glob("*.py") if p.name not in ("ncu_summary.py", "pytest_shard.py")))
def test_python_tools_import_and_parse_args(tool):
    """Each tool imports what it uses from the checkout (not an installed copy) and parses its options."""
    r = _run(f"perf/{tool}", "--help", timeout=300)
    assert r.returncode == 0 and "usage:" in r.stdout, r.stderr[-2000:]


@pytest.mark.parametrize("script", sorted(p.name for p in PERF.glob("*.sh")))
def test_shell_scripts_parse(script):
    r = subprocess.run(["bash", "-n", str(PERF / script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_scripts_name_only_existing_tools():
    """Every perf/<tool> a shell script or the README names exists."""
    named = set()
    for p in [*PERF.glob("*.sh"), PERF / "README.md"]:
        named |= set(re.findall(r"perf/([A-Za-z0-9_]+\.(?:py|sh))", p.read_text()))
        if p.suffix == ".md":
            named |= set(re.findall(r"^\| `([A-Za-z0-9_]+\.(?:py|sh))`", p.read_text(), re.M))
    missing = sorted(n for n in named if not (PERF / n).exists())
    assert not missing, missing


def test_no_private_globals_patched():
    """Nothing under perf/ assigns to another module's private names (build options are public parameters)."""
    bad = []
    for p in PERF.glob("*.py"):
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if re.search(r"\b[a-z_]\w*\.(_[A-Za-z]\w*)(\.clear\(\)|\s*=[^=])", line):
                bad.append(f"{p.name}:{i}: {line.strip()}")
    assert not bad, bad
