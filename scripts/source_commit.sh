#!/usr/bin/env bash
# Prints $SOURCE_COMMIT when the files of this checkout make the git tree $SOURCE_TREE
# (git write-tree over the working files; ignored build outputs do not count), else says on
# stderr what they make and exits 1. A copy of the sources sent to a GPU machine may carry
# an older .git than its files (seen on the lent H100: results said 4dd2170-dirty), so the
# device scripts stamp results with FUSEDNORM_COMMIT=$(bash scripts/source_commit.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
tree=$(git add -A . >/dev/null 2>&1 && git write-tree 2>/dev/null)
if [[ -n "${SOURCE_COMMIT:-}" && -n "$tree" && "$tree" == "${SOURCE_TREE:-}" ]]; then
  echo "$SOURCE_COMMIT"
  exit 0
fi
echo "files here make tree ${tree:-unknown}, not SOURCE_TREE=${SOURCE_TREE:-unset}" >&2
exit 1
