"""Run shard i of n of a pytest selection: the GPU suites do not fit one 10-minute device call.

    python3 perf/pytest_shard.py 2/3 tests/gdn -m "gpu or hopper" -q

Collects the selection (every argument after the shard), deals its test ids round-robin over n
shards (so the slow ones spread out), runs shard i's ids with the same options, and exits with
pytest's code. Shards 1..n together run every collected test once.
"""

from __future__ import annotations

import subprocess
import sys

import pytest


def main(argv: list[str]) -> int:
    if len(argv) < 1 or "/" not in argv[0]:
        raise SystemExit("usage: pytest_shard.py I/N [pytest args...]")
    i, n = (int(x) for x in argv[0].split("/"))
    if not 1 <= i <= n:
        raise SystemExit(f"shard {i}/{n}: I must be between 1 and N")
    args = argv[1:]
    quiet = [a for a in args if a not in ("-q", "-v", "-qq", "-vv")]  # one -q: a test id per line
    if "-n" in quiet:  # pytest-xdist workers: collect in one process (the run keeps them)
        j = quiet.index("-n")
        del quiet[j:j + 2]
    listing = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *quiet],
                             capture_output=True, text=True)
    ids = [line.strip() for line in listing.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if not ids:
        print(listing.stdout[-2000:], listing.stderr[-2000:], sep="\n")
        return listing.returncode or 5
    mine = ids[i - 1::n]
    # the options without the paths (the ids replace them); "-m EXPR"-style options keep their value
    opts, rest = [], iter(args)
    for a in rest:
        if a in ("-m", "-k", "-o", "-p", "-c", "-n", "--rootdir"):
            opts += [a, next(rest)]
        elif a.startswith("-"):
            opts.append(a)
    print(f"shard {i}/{n}: {len(mine)} of {len(ids)} tests", flush=True)
    return int(pytest.main([*opts, *mine]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
