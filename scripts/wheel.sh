#!/usr/bin/env bash
# Builds the distributable files into dist/: one abi3 wheel (CPython >= 3.11) for
# manylinux_2_28 (glibc >= 2.28: RHEL/Rocky/Alma 8, Debian 10, Ubuntu 20.04 and newer) and an
# sdist. The glibc floor comes from linking through zig (`ziglang` from PyPI), not from the
# build host's glibc, so no container is needed. The engine is built with Cargo's `dist`
# profile: the release build without debug info, stripped.
#
#   bash scripts/wheel.sh
#
# WALTZ_WHEEL_COMPAT overrides the platform policy (default manylinux_2_28; manylinux2014 also
# builds and passes auditwheel, for glibc >= 2.17: Amazon Linux 2 has 2.26). The build tools
# (maturin, ziglang, auditwheel) live in their own venv, target/wheel-tools. Prints the wheel's
# file, size and tag, and `auditwheel show`'s verdict; exits 1 if the wheel needs a newer glibc
# than its tag promises.
set -euo pipefail
cd "$(dirname "$0")/.."

compat=${WALTZ_WHEEL_COMPAT:-manylinux_2_28}
tools=target/wheel-tools
if ! "$tools/bin/python" -c "import ziglang, auditwheel" 2>/dev/null || [ ! -x "$tools/bin/maturin" ]; then
  echo "wheel: installing maturin, ziglang and auditwheel into $tools"
  "${PYTHON:-python3}" -m venv "$tools"
  "$tools/bin/python" -m pip install -q --upgrade pip
  "$tools/bin/python" -m pip install -q 'maturin>=1.16,<2' ziglang auditwheel
fi
# maturin runs zig as `python -m ziglang` with the first python on PATH: the tools venv's.
export PATH="$PWD/$tools/bin:$PATH"

rm -rf dist
echo "wheel: building the $compat wheel (release build through zig, a few minutes)"
maturin build --quiet --profile dist --zig --compatibility "$compat" --out dist
maturin sdist --out dist >/dev/null

wheel=$(ls dist/*.whl)
sdist=$(ls dist/*.tar.gz)
tag=$(basename "$wheel" .whl | cut -d- -f3-)
echo "wheel: $wheel"
echo "wheel: $(du -h "$wheel" | cut -f1) compressed, native library $(python3 - "$wheel" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    (so,) = [i for i in z.infolist() if i.filename.endswith(".so")]
    print(f"{so.file_size / 2**20:.1f} MiB ({so.filename})")
PY
)"
echo "wheel: tag $tag"
echo "sdist: $sdist ($(du -h "$sdist" | cut -f1))"

# auditwheel reads the symbol versions the library really needs: the policy it names must be at
# most the one in the wheel's tag.
report=$(auditwheel show "$wheel")
echo "$report" | sed 's/^/auditwheel: /'
policy=$(grep -o 'manylinux_[0-9]*_[0-9]*_[a-z0-9_]*' <<<"$report" | head -1)
python3 - "$policy" "$tag" <<'PY'
import re, sys
policy, tag = sys.argv[1:]
need = tuple(map(int, re.match(r"manylinux_(\d+)_(\d+)", policy).groups()))
have = tuple(map(int, re.search(r"manylinux_(\d+)_(\d+)", tag).groups()))
if need > have:
    sys.exit(f"wheel: the library needs glibc {need[0]}.{need[1]} but the tag says {have[0]}.{have[1]}")
print(f"wheel: auditwheel confirms {policy} (glibc {need[0]}.{need[1]}), within the tag's {have[0]}.{have[1]}")
PY

# PySpark finds the data source by the top-level module `pyspark_waltz`: it must be in the wheel
# beside `waltz` (pyproject's [tool.maturin] python-packages), or format("waltz") needs register().
python3 - "$wheel" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    names = set(z.namelist())
for module in ("waltz/__init__.py", "waltz/py.typed", "pyspark_waltz/__init__.py"):
    if module not in names:
        sys.exit(f"wheel: {module} is missing from the wheel")
print("wheel: holds waltz and pyspark_waltz")
PY
