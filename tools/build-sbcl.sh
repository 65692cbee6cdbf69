#!/usr/bin/env bash
# tools/build-sbcl.sh SOURCE PREFIX: build the SBCL whose source is in SOURCE
# (../shared/vendor/sbcl-2.6.7) once, installed under PREFIX, a folder outside
# the checkout, with Debian's SBCL as the host; print the path of its sbcl.
# A build already there is used as it is.  Its source needs no network;
# 5-9 minutes on 2 cores.
set -euo pipefail
source=$(cd "${1:?SOURCE}" && pwd)
prefix=${2:?PREFIX}
if [ -x "$prefix/bin/sbcl" ]; then
  echo "$prefix/bin/sbcl"
  exit 0
fi
work="$prefix.build"
rm -rf "$work"
mkdir -p "$work" "$prefix"
cp -r "$source/." "$work/"
cd "$work"
# The copy in ../shared/vendor holds the repository's symbolic links as
# files naming their target (contrib/sb-manual/doc/*.lisp): made links again.
find . -type f -size -200c -print0 | while IFS= read -r -d '' file; do
  target=$(cat "$file")
  case "$target" in
    ../*) if [ -e "$(dirname "$file")/$target" ] && [ "$(wc -l < "$file")" -eq 0 ]; then
            ln -sf "$target" "$file"
          fi ;;
  esac
done
# A release tarball carries its version; this copy, made from the
# repository without its history, may not.
if [ ! -f version.lisp-expr ]; then
  echo "\"$(basename "$source" | sed 's/^sbcl-//')\"" > version.lisp-expr
fi
sh make.sh --prefix="$prefix" > "$work.log" 2>&1 || { tail -40 "$work.log" >&2; exit 1; }
sh install.sh >> "$work.log" 2>&1 || { tail -40 "$work.log" >&2; exit 1; }
cd /
rm -rf "$work"
echo "$prefix/bin/sbcl"
