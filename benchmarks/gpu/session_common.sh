# Sourced by a device session script (remainders_session.sh): the carried wheels installed into
# /tmp/site, PYTHONPATH with .gpusite, multicast off, the card's name in $OUT/card.txt, and
# part NAME SECONDS CMD... (one bounded part, its log in $OUT/NAME.log; skipped unless NAME is in
# $PARTS when PARTS is set; STATUS=1 when a part fails); bundle (every log into $OUT/logs.tgz:
# the device returns at most 8 files).
OUT=${OUT:-benchmarks/results/gpu/local}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/pip.log" 2>&1 || echo "wheel install failed (see pip.log)"
fi
export PYTHONPATH="$PWD:$PWD/.gpusite:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 NCCL_MNNVL_ENABLE=0 NCCL_CUMEM_ENABLE=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/card.txt"
STATUS=0
part() {
  local name=$1 limit=$2; shift 2
  if [ -n "${PARTS:-}" ]; then case " $PARTS " in *" $name "*) ;; *) return 0 ;; esac; fi
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -12 "$OUT/$name.log"
  echo "== $name: exit $rc in $((SECONDS - t0)) s (limit $limit s)" | tee -a "$OUT/session.log"
  [ $rc -eq 0 ] || STATUS=1
}
bundle() {  # the device returns at most 8 files: every log goes back in one archive
  (cd "$OUT" && tar czf logs.tgz --remove-files $(ls *.log 2>/dev/null)) || true
}
