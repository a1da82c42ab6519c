#!/usr/bin/env bash
# make test-compat: the version-sensitive tests at both ends of the dependency ranges in pyproject.toml.
#
# For each set in COMPAT_SETS (default "newest oldest") it builds an environment in $COMPAT_DIR/<set> (default
# .compat/, ignored by git) where the pack is installed from its built wheel, as a user installs it, not from the
# editable checkout:
#   newest  the newest release of every dependency that pyproject.toml allows (pip --upgrade-strategy eager);
#   oldest  constraints/oldest.txt: the lower bound of every range.
# Then it runs the fast suite, and the end-to-end, FSDP1, resume (preemption), smoke and copied-recipe tests
# (COMPAT_SLOW), with that environment's python (make's VENV points there too, for the tests that call make).
# Output goes to $COMPAT_DIR/<set>.log; one result line per set at the end. Needs PyPI: torch from PyPI brings CUDA
# libraries, a few GB per set. A pip configuration that caps a version (a constraint file in pip.conf) caps "newest"
# too: the versions line says what was installed, and releases newer than those are listed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
COMPAT_DIR=$(realpath -m "${COMPAT_DIR:-.compat}")  # absolute: the checks below run from elsewhere
SETS=${COMPAT_SETS:-newest oldest}
PACKAGES=(torch transformers trl peft accelerate datasets tensorboard)
# the launches after the fast suite; COMPAT_SLOW="" runs the fast suite only (quick re-checks of a fix)
LAUNCH_TESTS="tests/test_end_to_end.py tests/test_fsdp1.py tests/test_grad_accumulation.py tests/test_preemption.py tests/test_smoke.py"
read -r -a SLOW <<< "${COMPAT_SLOW-$LAUNCH_TESTS tests/test_copy_recipe.py}"

mkdir -p "$COMPAT_DIR"
rm -rf "$COMPAT_DIR/dist"
"$PYTHON" -m pip wheel --quiet --disable-pip-version-check --no-deps --wheel-dir "$COMPAT_DIR/dist" .
wheels=("$COMPAT_DIR"/dist/fsdp_recipes-*.whl)
wheel=${wheels[0]}
echo "[compat] built $wheel"

versions() {  # "torch 2.15.0, transformers 5.24.0, ..." as installed in env $1
  "$1/bin/python" - "${PACKAGES[@]}" <<'PY'
import sys
from importlib.metadata import version
print(", ".join(f"{p} {version(p)}" for p in sys.argv[1:]))
PY
}

summary=()
status=0
for set in $SETS; do
  env="$COMPAT_DIR/$set"
  log="$COMPAT_DIR/$set.log"
  [ -x "$env/bin/python" ] || "$PYTHON" -m venv "$env"
  pip=("$env/bin/python" -m pip --disable-pip-version-check)
  case "$set" in
    newest) "${pip[@]}" install --upgrade --upgrade-strategy eager "${wheel}[test]" ;;
    oldest) "${pip[@]}" install --upgrade -c constraints/oldest.txt "${wheel}[test]" ;;
    *) echo "error: unknown compat set '$set'. Fix: COMPAT_SETS=\"newest oldest\" (either or both)" >&2; exit 2 ;;
  esac
  "${pip[@]}" install --quiet --no-deps --force-reinstall "$wheel"  # this checkout's wheel, same version number
  touch "$env/.installed"  # the Makefile's stamp: the tests' `make smoke` uses this env as it is (VENV below)
  # the pack must come from the wheel in site-packages, not from the checkout
  where=$(cd / && "$env/bin/python" -c 'import fsdp_recipes; print(fsdp_recipes.__file__)')
  case "$where" in
    "$env"/*) ;;
    *) echo "error: $set: fsdp_recipes imports from $where, not from the wheel in $env" >&2; exit 1 ;;
  esac
  installed=$(versions "$env")
  echo "[compat] $set: $installed"
  if [ "$set" = newest ]; then
    # pip list --outdated asks the index for every installed package: seconds; json, since it refuses "freeze"
    newer=$("${pip[@]}" list --outdated --format=json | "$env/bin/python" -c '
import json, sys
wanted = set(sys.argv[1:])
print(" ".join(p["name"] + " " + p["latest_version"] for p in json.load(sys.stdin) if p["name"].lower() in wanted))
' "${PACKAGES[@]}")
    [ -z "$newer" ] || echo "[compat] newest: PyPI has newer releases than installed (outside pyproject's ranges," \
      "or capped by your pip config): $newer"
  fi
  start=$SECONDS
  set +e
  {
    echo "== $set: $installed"
    PATH="$env/bin:$PATH" VENV="$env" "$env/bin/python" -m pytest -q -p no:cacheprovider -m "not slow"
    fast=$?
    slow=0
    if [ ${#SLOW[@]} -gt 0 ]; then
      PATH="$env/bin:$PATH" VENV="$env" "$env/bin/python" -m pytest -q -p no:cacheprovider --durations=10 "${SLOW[@]}"
      slow=$?
    fi
    echo "[compat] exit codes: fast $fast, slow $slow"
    [ $fast -eq 0 ] && [ $slow -eq 0 ]
  } 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  set -e
  results=$(grep -E "[0-9]+ (passed|failed|errors?)\b.* in [0-9.]+s" "$log" | tr '\n' ';' || true)
  line="[compat] $set: $([ "$rc" -eq 0 ] && echo PASSED || echo FAILED) in $((SECONDS - start))s ($installed): $results"
  summary+=("$line")
  [ "$rc" -eq 0 ] || status=1
done
printf '%s\n' "${summary[@]}"
exit $status
