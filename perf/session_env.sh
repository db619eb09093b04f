# Sourced by the perf/*_session.sh device scripts (run from the repository root): shell options,
# $OUT (default perf/out), PYTHONPATH on the checkout, and PYTEST_OPTS for an image whose pytest
# lacks pytest-benchmark (the project's addopts name its options).
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/perf/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PYTEST_OPTS=()
python3 -c "import pytest_benchmark" 2>/dev/null || PYTEST_OPTS=(-o "addopts=-ra" -p no:cacheprovider)
