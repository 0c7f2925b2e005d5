#!/usr/bin/env bash
# Build the peer environment .venv-peers: DyNet 2.1.2 (for the dynet-noauto/-depth/-agenda
# benchmark modes), CPU PyTorch and flybatch itself (editable), so that
#   .venv-peers/bin/python -m flybatch.bench.dynet_peer TASK --strategy agenda
# runs.  Idempotent: each step is skipped when already done.  DyNet compiles from source
# (several minutes).  Never part of `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-peers
PY="$VENV/bin/python"
EIGEN="${EIGEN3_INCLUDE_DIR:-/usr/include/eigen3}"   # libeigen3-dev (Debian/Ubuntu) installs here

# 1. System packages: Eigen headers and CMake (DyNet's build needs both).
if [ ! -f "$EIGEN/Eigen/Core" ] || ! command -v cmake >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
    $SUDO apt-get install -y libeigen3-dev cmake \
        || { $SUDO apt-get update && $SUDO apt-get install -y libeigen3-dev cmake; }
fi

# 2. The virtual environment.
if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
fi

# 3. DyNet's build requirements.  Cython 3 cannot compile DyNet 2.1.2's bindings, and
#    --no-build-isolation needs setuptools with bdist_wheel (or the wheel package).
"$PY" -m pip install -q "cython<3" numpy setuptools wheel

# 4. DyNet itself, compiled against the system Eigen.
if ! "$PY" -c "import dynet_config" >/dev/null 2>&1; then
    EIGEN3_INCLUDE_DIR="$EIGEN" "$PY" -m pip install --no-build-isolation --no-deps "dynet==2.1.2"
fi

# 5. CPU PyTorch (the constraints file pins the local CPU wheel), then flybatch, editable,
#    with its other runtime dependencies (greenlet, ...); torch and numpy are already there.
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install -c constraints.txt torch==2.13.0
fi
"$PY" -m pip install -q -c constraints.txt -e .

# 6. Check: DyNet imports with autobatching on and computes; flybatch's peer imports.
"$PY" - <<'PYEOF'
import dynet_config
dynet_config.set(autobatch=1, mem="256", random_seed=1)
import dynet as dy
x = dy.inputVector([1.0, 2.0])
assert abs(dy.sum_elems(x * 2).value() - 6.0) < 1e-6
import flybatch.bench.dynet_peer  # noqa: F401
print("peers ok: dynet", dy.__version__ if hasattr(dy, "__version__") else "2.1.2")
PYEOF
