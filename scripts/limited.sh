# Sourced by the GPU benchmark scripts. limited SECONDS COMMAND...: the command, stopped (and the script with it)
# past SECONDS.
limited() {
    local seconds=$1 rc=0
    shift
    timeout "$seconds" "$@" || rc=$?
    if [ "$rc" -eq 124 ]; then echo "$(basename "$0"): stopped after ${seconds}s: $*" >&2; fi
    if [ "$rc" -ne 0 ]; then exit "$rc"; fi
}
