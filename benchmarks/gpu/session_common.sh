# Sourced by a device session script (remainders_session.sh): the carried wheels installed into
# /tmp/site, PYTHONPATH with .gpusite, multicast off, the card's name in $OUT/card.txt, and
# session_part.sh's part and bundle.
OUT=${OUT:-benchmarks/results/gpu/local}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/pip.log" 2>&1 || echo "wheel install failed (see pip.log)"
fi
export PYTHONPATH="$PWD:$PWD/.gpusite:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 NCCL_MNNVL_ENABLE=0 NCCL_CUMEM_ENABLE=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/card.txt"
source "$(dirname "${BASH_SOURCE[0]}")/session_part.sh"
