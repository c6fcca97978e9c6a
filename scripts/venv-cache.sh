# Virtual environments built once per content and reused by every checkout (sourced by the setup scripts).
#
#   venv_from_cache NAME KEY VENV BUILD
#
# makes VENV (a path in this checkout) a venv whose packages are those BUILD installed into the cached venv
# $AGENTGYM_VENV_CACHE/NAME-KEY. The cache is built once per KEY (BUILD is called with its path, under a lock,
# and it counts only when BUILD finished: a stamp file is written last), then VENV is a hard-linked copy of it:
# about a second and no space for ~60,000 files, where pip took 1-2 minutes for each checkout (CI's clean checkout
# ran all three of the platform's environments' installs every time). The copy is a plain venv of its own: its
# scripts' interpreter lines are rewritten to VENV's python, and files are only ever replaced in it (pip, sed -i
# and Python's bytecode writes rename a new file into place), so nothing done in a checkout changes the cache.
# A VENV whose stamp already has KEY is left as it is. The two newest caches of each NAME are kept.
#
#   venv_key FILE...    # KEY: the files' contents and the interpreter's version

AGENTGYM_VENV_CACHE=${AGENTGYM_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/agentgym-venvs}
VENV_CACHE_KEEP=${VENV_CACHE_KEEP:-2}
VENV_STAMP=.agentgym-venv-key

venv_key() {
  { "${PYTHON:-python3}" -c 'import sys; print(sys.version)'; cat "$@"; } | sha256sum | cut -c1-16
}

venv_from_cache() {
  local name=$1 key=$2 venv=$3 build=$4
  local cache="$AGENTGYM_VENV_CACHE/$name-$key"
  if [ -f "$venv/$VENV_STAMP" ] && [ "$(cat "$venv/$VENV_STAMP")" = "$key" ] && "$venv/bin/python" -c "" 2>/dev/null
  then
    return 0
  fi
  mkdir -p "$AGENTGYM_VENV_CACHE" "$(dirname "$venv")"
  local target
  target="$(cd "$(dirname "$venv")" && pwd)/$(basename "$venv")"
  (
    flock 9
    if [ ! -f "$cache/$VENV_STAMP" ]; then
      echo "building the $name environment once for every checkout: $cache"
      rm -rf "$cache"
      "${PYTHON:-python3}" -m venv "$cache"
      "$build" "$cache"
      echo "$key" >"$cache/$VENV_STAMP"
    fi
    touch "$cache/$VENV_STAMP"  # the most recently used: kept by the eviction below
    local stale
    ls -1dt "$AGENTGYM_VENV_CACHE/$name"-*/"$VENV_STAMP" 2>/dev/null | tail -n +"$((VENV_CACHE_KEEP + 1))" \
      | while IFS= read -r stale; do rm -rf "$(dirname "$stale")"; done
    for stale in "$AGENTGYM_VENV_CACHE/$name"-*/; do  # builds that never finished (killed), but not this one
      if [ "${stale%/}" != "$cache" ] && [ ! -f "$stale/$VENV_STAMP" ]; then rm -rf "$stale"; fi
    done
    rm -rf "$target"
    cp -al "$cache" "$target" 2>/dev/null || { rm -rf "$target"; cp -a "$cache" "$target"; }  # another filesystem
  ) 9>"$AGENTGYM_VENV_CACHE/$name.lock"
  # Interpreter lines (and activate scripts) name the cache's python: this copy's own instead. sed -i writes a new
  # file, so the cache's stays as it was.
  grep -rlIF --null -- "$cache" "$target/bin" "$target/pyvenv.cfg" | xargs -0 -r sed -i "s|$cache|$target|g"
  rm -f "$target/$VENV_STAMP"  # a hard link to the cache's: a new file, not a write through it
  echo "$key" >"$target/$VENV_STAMP"
}
