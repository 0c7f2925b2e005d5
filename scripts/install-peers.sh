#!/usr/bin/env bash
# Build the DyNet peer environments for the dynet-noauto/-depth/-agenda benchmark modes:
#
#   .venv-peers      DyNet 2.1.2, compiled from its sdist against the system Eigen (minutes)
#   .venv-peers-22   DyNet 2.2, the prebuilt manylinux wheel of PyPI's `dynet38` (seconds;
#                    built by the taishi-i/dynet fork from DyNet's master for Python 3.8+)
#
#   scripts/install-peers.sh [all|2.1.2|2.2]      (default all; `make peers DYNET=2.2`)
#
# Both are measured because neither is plainly the fair peer: 2.1.2 is DyNet's last source
# release, 2.2 its last build and the faster one on our machines.  The benchmark runs the one
# `--dynet` names (default 2.2 when installed) and records which in every result.  Each venv
# gets CPU PyTorch and numpy, and sees flybatch through a .pth file pointing at src/ (no second
# build of the compiled core: `make peers` builds it in .venv first, for the same Python).
# Idempotent: each step is skipped when already done.  Never part of `make test`.
#
# Environment: PYTHON (default python3), JOBS (compile jobs, default nproc),
# EIGEN3_INCLUDE_DIR (default /usr/include/eigen3, where Debian's libeigen3-dev puts it).
set -euo pipefail
cd "$(dirname "$0")/.."

WHICH="${1:-all}"
case "$WHICH" in all|2.1.2|2.2) ;; *) echo "usage: $0 [all|2.1.2|2.2]" >&2; exit 2 ;; esac
PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-$(nproc)}"
EIGEN="${EIGEN3_INCLUDE_DIR:-/usr/include/eigen3}"
SRC="$(pwd)/src"

apt_install() {
    local sudo=""
    if [ "$(id -u)" != 0 ]; then sudo=sudo; fi
    $sudo apt-get install -y "$@" || { $sudo apt-get update && $sudo apt-get install -y "$@"; }
}

# A venv with numpy, CPU PyTorch (constraints.txt pins the CPU wheel; a bare `torch` would pull
# the CUDA packages) and flybatch's other runtime dependency, flybatch itself on the path.
make_venv() {
    local venv="$1"
    if [ ! -x "$venv/bin/python" ]; then
        "$PYTHON" -m venv "$venv"
    fi
    if ! "$venv/bin/python" -c "import torch, numpy, greenlet" >/dev/null 2>&1; then
        "$venv/bin/python" -m pip install -q -c constraints.txt torch numpy greenlet
    fi
    local site
    site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "$SRC" > "$site/flybatch-src.pth"
}

# DyNet 2.1.2's setup.py chdirs into its CMake build directory (build/pyX.Y-64bit/python) in
# build_py and stays there for the rest of the build.  Today's setuptools collects license files
# (LICEN[CS]E*: LICENSE.txt) by paths relative to the working directory when bdist_wheel writes
# the wheel's metadata, after that chdir, so the build fails with "No such file or directory:
# 'LICENSE.txt'" whatever the `wheel` version.  Patched in a scratch copy of the sdist: build_py
# copies LICENSE.txt into the directory it moves to (moving back instead would split the build
# between two directories).  Its Cython bindings need Cython < 3.
install_212() {
    local venv=.venv-peers py=.venv-peers/bin/python
    make_venv "$venv"
    if "$py" -c "import dynet_config" >/dev/null 2>&1; then return; fi
    if [ ! -f "$EIGEN/Eigen/Core" ] || ! command -v cmake >/dev/null 2>&1; then
        apt_install libeigen3-dev cmake
    fi
    "$py" -m pip install -q "cython<3" setuptools wheel
    local tmp
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' RETURN
    "$py" -m pip download -q -d "$tmp" --no-deps --no-binary :all: "dynet==2.1.2"
    tar -xzf "$tmp"/dyNET-2.1.2.tar.gz -C "$tmp"
    local dir="$tmp/dyNET-2.1.2"
    "$py" - "$dir/setup.py" <<'PYEOF'
import sys
path = sys.argv[1]
text = open(path, encoding="utf-8-sig").read()
old = '        os.chdir(os.path.join(BUILD_DIR, "python"))\n'
new = old + '        copy(os.path.join(SCRIPT_DIR, "LICENSE.txt"), ".")\n'
assert text.count(old) == 1, "unexpected DyNet setup.py: build_py changed"
open(path, "w", encoding="utf-8").write(text.replace(old, new))
PYEOF
    EIGEN3_INCLUDE_DIR="$EIGEN" MAKE_FLAGS="-j$JOBS" \
        "$py" -m pip install --no-build-isolation --no-deps "$dir"
}

install_22() {
    local venv=.venv-peers-22 py=.venv-peers-22/bin/python
    make_venv "$venv"
    if ! "$py" -c "import dynet_config" >/dev/null 2>&1; then
        "$py" -m pip install -q --no-deps "dynet38==2.2"
    fi
}

# Imports DyNet with autobatching, computes, and imports the peer (flybatch, torch included).
check() {
    "$1/bin/python" - <<'PYEOF'
import dynet_config
dynet_config.set(autobatch=1, mem="256", random_seed=1)
import dynet as dy
x = dy.inputVector([1.0, 2.0])
assert abs(dy.sum_elems(x * 2).value() - 6.0) < 1e-6
import sys
try:
    from flybatch.bench import dynet_peer
except ImportError as e:  # the compiled core is built by `make` (`make peers` does it first)
    sys.exit(f"DyNet works, but flybatch does not import ({e}): run `make peers`")
print("peers ok: DyNet", dynet_peer.dynet_version(), "in", sys.prefix)
PYEOF
}

if [ "$WHICH" != 2.2 ]; then install_212; check .venv-peers; fi
if [ "$WHICH" != 2.1.2 ]; then install_22; check .venv-peers-22; fi
