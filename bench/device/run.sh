#!/usr/bin/env bash
# The device check on a lent GPU machine, from the repository root of the carried tree, with
# .device/ carried (bench/device/prepare.sh fills it here). Through the device tool:
#   run(command="bash bench/device/run.sh", carry=[".device"], timeout_s=540)
# Builds tpusync there (its native extension and tpusync-sidecar, against the carried headers
# and static libraries), then runs bench/device_check.py on the GPU; the JSON lands in $OUT (the
# tool brings it back: copy it to bench/results/device.json) or in bench/results/ without one.
set -euo pipefail
carry=${DEVICE_CARRY:-.device}
[ -d "$carry/debs" ] && [ -d "$carry/wheels" ] || { echo "no $carry/: run bench/device/prepare.sh here first" >&2; exit 2; }
# A prefix of its own (not --target, which drops the wheel's scripts: tpusync-sidecar among them).
sysroot=/tmp/tpusync-sysroot prefix=/tmp/tpusync-prefix
mkdir -p "$sysroot" "$prefix"
for deb in "$carry"/debs/*.deb; do dpkg-deb -x "$deb" "$sysroot"; done
site=$(python3 -c "import sysconfig as s; v = {'base': '$prefix', 'platbase': '$prefix'}; \
print(s.get_path('purelib', vars=v) + ':' + s.get_path('platlib', vars=v))")
export PYTHONPATH=$site PATH=$prefix/bin:$PATH PYTHONUNBUFFERED=1 TPUSYNC_DOWNLOADS=$PWD/$carry/downloads
python3 -m pip install -q --no-index --no-deps --no-compile --prefix "$prefix" "$carry"/wheels/*.whl
start=$(date +%s)
# FindOpenSSL looks in <root>/lib, not Debian's multiarch directory: its paths are named.
CMAKE_ARGS="-DCMAKE_PREFIX_PATH=$sysroot/usr -DOPENSSL_USE_STATIC_LIBS=TRUE -DOPENSSL_INCLUDE_DIR=$sysroot/usr/include \
-DOPENSSL_CRYPTO_LIBRARY=$sysroot/usr/lib/x86_64-linux-gnu/libcrypto.a" \
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --prefix "$prefix" .
echo "device: tpusync built in $(( $(date +%s) - start )) s"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import jax; print('device: jax', jax.__version__, jax.devices())"
results=${OUT:-bench/results}
# DEVICE_CHECK_ARGS: more of device_check.py's flags (--quick: the small sizes make test runs).
python3 bench/device_check.py --platform "${DEVICE_PLATFORM:-cuda}" --out "$results/device.json" ${DEVICE_CHECK_ARGS:-}
