#!/usr/bin/env bash
# The Python packages the lent GPU machine lacks, as wheels in .gpu_wheels/ (git-ignored), and the commit they go
# with; run here, with network, before scripts/gpu_check.sh runs there (the device tool carries .gpu_wheels).
#
#   bash scripts/prepare_gpu_wheels.sh [DIR]      # DIR: default .gpu_wheels
#
# The machine (docs/gpu.md): Python 3.12 on x86-64, its own torch (2.11.0+cu130 on the H200) and numpy, packaging,
# psutil, py-cpuinfo, msgpack, ninja, einops, tqdm; no DeepSpeed, pydantic or hjson; no network, no git. Brought:
#   deepspeed          this checkout's version; PyPI has only its sdist, so it is built here into a wheel without
#                      its C++/CUDA ops (DS_BUILD_OPS=0, what `pip install deepspeed` does; the check builds no op)
#   pydantic           with pydantic-core (a binary wheel: cp312, manylinux, x86-64), annotated-types and
#                      typing-inspection; typing-extensions too (the machine's may be older than pydantic's floor)
#   hjson
# each at the version this checkout's venv runs (a set known to work together). Then DIR/COMMIT names the commit
# they were prepared at (and whether the tree had uncommitted changes), DIR/MANIFEST holds the SHA-256 of every
# file the device tool carries (scripts/gpu_check_plan.py record), against which the report checks the tree it
# ran (it names the commit, and the files that differ, without git), and the script checks that the tree and the
# wheels stay under the device tool's 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.gpu_wheels}
PY=${FDG_VENV:-.venv}/bin/python
LIMIT_MIB=60  # the device tool carries 64 MiB in all: the tree, shared/ and the carried folders
rm -rf "$DIR"
mkdir -p "$DIR"
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }

DS=$(version deepspeed)
if ! "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DIR" "deepspeed==$DS" 2>/dev/null; then
  sdist=$(mktemp -d)
  trap 'rm -rf "$sdist"' EXIT
  "$PY" -m pip download -q --no-deps --no-binary=:all: -d "$sdist" "deepspeed==$DS"
  # --no-build-isolation: DeepSpeed's setup.py imports torch (the venv's); the wheel itself is pure Python
  DS_BUILD_OPS=0 DS_ACCELERATOR=cpu "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DIR" "$sdist"/deepspeed-*
fi
PLATFORM=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64)  # the machine's interpreter, not this one's
for pkg in pydantic pydantic_core annotated_types typing_inspection typing_extensions hjson; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: "${PLATFORM[@]}" -d "$DIR" "$pkg==$(version "$pkg")"
done

commit=$("$PY" scripts/gpu_check_plan.py record "$DIR")  # DIR/COMMIT and DIR/MANIFEST

wheels=$(du -sk "$DIR" | cut -f1)
tree=$(git ls-files -co --exclude-standard -z | du -ck --files0-from=- 2>/dev/null | tail -n 1 | cut -f1)
total=$(((wheels + tree) / 1024))
ls -1 "$DIR"
echo "wheels $((wheels / 1024)) MiB + tree $((tree / 1024)) MiB = $total MiB (limit $LIMIT_MIB MiB); commit $commit"
if ((total > LIMIT_MIB)); then
  echo "too large to carry: the device tool takes 64 MiB in all" >&2
  exit 1
fi
