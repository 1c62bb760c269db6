# Sourced by the device session scripts (session_common.sh, kernels_session.sh):
#   part NAME SECONDS CMD...   one bounded part, its log in $OUT/NAME.log, a line in $OUT/session.log;
#                              it runs when $PARTS (names split by commas or spaces) is empty, "all" or names it;
#                              STATUS=1 when a part fails.
#   bundle                     every log into $OUT/logs.tgz (the device returns at most 8 files).
STATUS=${STATUS:-0}
part() {
  local name=$1 limit=$2; shift 2
  case " ${PARTS//,/ } " in "  "|*" all "*|*" $name "*) ;; *) return 0 ;; esac
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -12 "$OUT/$name.log"
  echo "== $name: exit $rc in $((SECONDS - t0)) s (limit $limit s)" | tee -a "$OUT/session.log"
  [ $rc -eq 0 ] || STATUS=1
}
bundle() {
  (cd "$OUT" && tar czf logs.tgz --remove-files $(ls *.log 2>/dev/null)) || true
}
