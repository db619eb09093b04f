"""Check that a built wheel, and its install in a clean venv, hold every kernel source, config file and
shipped model file.

    python .ci/check_wheel.py WHEEL [SITE_PACKAGES]

The expected files are the repository's CUDA sources and headers (<pkg>/csrc/*.cu, *.cuh), config
JSON files (<pkg>/configs/*.json) and the shipped models' files (specpilot/models/<name>/*: config, W12
weights, held-out text, training record; `specpilot demo` reads them) of the shipped packages. Each must be in the wheel's file list, and,
with SITE_PACKAGES (the clean venv's), on disk there. Exit status 1 names what is missing.
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("w12", "gdn", "tree_attn", "lmhead", "autotune", "specpilot")
PATTERNS = ("**/csrc/*.cu", "**/csrc/*.cuh", "**/configs/*.json", "models/*/*.json", "models/*/*.txt",
            "models/*/*.safetensors")


def expected() -> list[str]:
    files = set()
    for pkg in PACKAGES:
        if (ROOT / pkg).is_dir():
            for pat in PATTERNS:
                files |= {p.relative_to(ROOT).as_posix() for p in (ROOT / pkg).glob(pat)}
    return sorted(files)


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    want = expected()
    if not any(f.endswith(".cu") for f in want):
        print("check_wheel: found no kernel sources in the repository; is ROOT right?", file=sys.stderr)
        return 1
    names = set(zipfile.ZipFile(argv[1]).namelist())
    missing = [f for f in want if f not in names]
    if len(argv) == 3:
        site = Path(argv[2])
        missing += [f"{f} (installed)" for f in want if not (site / f).is_file()]
    if missing:
        print(f"check_wheel: {len(missing)} of {len(want)} files missing from {Path(argv[1]).name}:", file=sys.stderr)
        for f in missing:
            print(f"  {f}", file=sys.stderr)
        return 1
    print(f"check_wheel: all {len(want)} kernel sources, config and model files are in {Path(argv[1]).name}"
          + (" and its install" if len(argv) == 3 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
