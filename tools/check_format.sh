#!/usr/bin/env bash
# clang-format check of the C, C++ and CUDA files listed in tools/format_files.txt, against the
# repository's .clang-format (make test runs it).
#   tools/check_format.sh               the listed files must be formatted (exit 1 otherwise,
#                                       with clang-format's diff of each)
#   tools/check_format.sh --candidates  tracked C/C++/CUDA files not listed that are formatted
#                                       already (they can be added to the list)
#   tools/check_format.sh --fix FILE... format FILEs in place (then list them)
# .clang-format describes the code as it is written; most of the tree predates it and is not
# reformatted wholesale. The list holds the files that follow it: a file is added once it is
# formatted (a new file should be, from the start), and never leaves the list. clang-format's
# output differs between its major versions: the list is checked with Debian 12's clang-format
# 14 (CLANG_FORMAT names another binary).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
LIST="$ROOT/tools/format_files.txt"
CF=${CLANG_FORMAT:-clang-format}
command -v "$CF" >/dev/null || { echo "check_format: $CF not found (make setup installs clang-format)" >&2; exit 1; }
cd "$ROOT"
echo "check_format: $("$CF" --version)"

formatted() {  # formatted FILE: clang-format would change nothing
  "$CF" --style=file --dry-run --Werror "$1" >/dev/null 2>&1
}

case ${1:-} in
  --fix)
    shift
    [ $# -gt 0 ] || { echo "usage: $0 --fix FILE..." >&2; exit 2; }
    exec "$CF" --style=file -i "$@" ;;
  --candidates)
    git ls-files '*.c' '*.h' '*.cc' '*.cpp' '*.hpp' '*.cu' '*.cuh' | while read -r f; do
      grep -qxF "$f" "$LIST" || ! formatted "$f" || echo "$f"
    done
    exit 0 ;;
  "") ;;
  *) echo "usage: $0 [--candidates | --fix FILE...]" >&2; exit 2 ;;
esac

status=0; n=0
while read -r f; do
  case $f in ''|'#'*) continue ;; esac
  n=$((n + 1))
  if [ ! -f "$f" ]; then
    echo "$f: listed in tools/format_files.txt but not found"; status=1
  elif ! formatted "$f"; then
    echo "$f: not formatted; clang-format's version of it differs:"
    "$CF" --style=file "$f" | diff -u "$f" - | sed 's/^/    /'
    status=1
  fi
done <"$LIST"
echo "check_format: $n files listed, $([ $status -eq 0 ] && echo "all formatted" || echo "some not formatted (tools/check_format.sh --fix FILE)")"
exit $status
