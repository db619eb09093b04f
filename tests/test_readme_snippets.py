"""Every ```python block of the README and of docs/*.md runs as written, so the Quickstart cannot rot.

The blocks run in one fresh Python process (one torch import for all), each block in a namespace of its own
and in a scratch folder, with TRITON_INTERPRET unset: what a user who pastes a block into `python` gets. On
this CPU machine that is the CPU path; on a GPU machine the same blocks run on the GPU (each picks
`device = "cuda" if torch.cuda.is_available() else "cpu"`).

A block whose first line starts with "# Signatures" lists call signatures with their defaults, not a program,
and is not run. The process uses one CPU thread (OMP_NUM_THREADS=1): the blocks' matmuls are small, and on a
2-core machine running other tests a second OpenMP thread makes them several times slower (about 26 s in all
with one thread).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP = "# Signatures"

RUNNER = r'''
import json, sys, time, traceback
blocks = json.load(sys.stdin)
out = []
for b in blocks:
    t0 = time.perf_counter()
    try:
        exec(compile(b["code"], f"{b['file']}:{b['line']}", "exec"), {"__name__": "__main__"})
        err = None
    except BaseException:
        err = traceback.format_exc(limit=-6)
    out.append({"file": b["file"], "line": b["line"], "error": err, "seconds": round(time.perf_counter() - t0, 2)})
print("RESULTS " + json.dumps(out))
'''


def python_blocks(path: Path) -> list[dict]:
    """The ```python blocks of a markdown file: {"file", "line" (of the first code line), "code"}."""
    blocks, cur, start = [], None, 0
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if cur is None and re.fullmatch(r"```python\s*", line):
            cur, start = [], i + 1
        elif cur is not None and line.strip() == "```":
            blocks.append({"file": str(path.relative_to(ROOT)), "line": start, "code": "\n".join(cur) + "\n"})
            cur = None
        elif cur is not None:
            cur.append(line)
    return blocks


def all_blocks() -> list[dict]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [b for f in files for b in python_blocks(f)]


def test_blocks_are_found():
    blocks = all_blocks()
    readme = [b for b in blocks if b["file"] == "README.md"]
    assert len(readme) >= 6, [b["line"] for b in readme]  # w12, gdn, tree_attn, lmhead, engine, autotune.force
    assert any(b["file"] == "docs/engine.md" for b in blocks)
    assert not [b for b in readme if b["code"].lstrip().startswith(SKIP)]  # the README's blocks are all programs


@pytest.mark.slow
def test_every_python_block_runs(tmp_path):
    blocks = [b for b in all_blocks() if not b["code"].lstrip().startswith(SKIP)]
    env = {**os.environ, "SPECPILOT_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)  # a user's plain `python`
    r = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(blocks), capture_output=True, text=True,
                       timeout=600, env=env, cwd=tmp_path)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULTS ")), None)
    assert line is not None, r.stdout[-3000:] + r.stderr[-3000:]
    results = json.loads(line[len("RESULTS "):])
    assert len(results) == len(blocks)
    failed = [f"{x['file']}:{x['line']}\n{x['error']}" for x in results if x["error"]]
    assert not failed, "\n\n".join(failed)
