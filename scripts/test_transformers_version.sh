#!/usr/bin/env bash
# Run nnterp's test suites against one transformers release, in that release's own virtual environment.
#
#   scripts/test_transformers_version.sh VERSION [pytest args...]
#
#   scripts/test_transformers_version.sh 5.20.2                      # the default suites, below
#   scripts/test_transformers_version.sh 5.20.2 tests/test_contract.py -k olmo
#
# The environment lives under $NNTERP_VENVS (default ~/.cache/nnterp/venvs/transformers-VERSION) and is
# reused: it is built once (torch==2.13.0, this package with its test extras, transformers==VERSION) and
# marked complete only when the build succeeded. The package is installed editable, so every run tests the
# working tree; a run from another checkout re-points it. Tiny checkpoints are cached per transformers
# release by `nnterp.testing` ($NNTERP_CACHE), so the first run of a release also builds its fixtures.
#
# Without a test path among the pytest args it runs the contract suite, the component suites (the recurrent
# mixers'), the family suites, the fast path's and the oracles' own tests, and the long-context profile (whose
# chunked prefill depends on the release's cache keyword and cache layout); the exit status is pytest's.
set -euo pipefail

if [[ $# -lt 1 || "$1" == -* ]]; then
    echo "usage: $0 VERSION [pytest args...]   (e.g. $0 5.20.2)" >&2
    exit 2
fi
version="$1"
shift
repo="$(cd "$(dirname "$0")/.." && pwd)"
venvs="${NNTERP_VENVS:-$HOME/.cache/nnterp/venvs}"
venv="$venvs/transformers-$version"
python="${PYTHON:-python3}"

if [[ ! -f "$venv/.complete" ]]; then
    echo "== building $venv" >&2
    rm -rf "$venv"
    mkdir -p "$venvs"
    "$python" -m venv "$venv"
    "$venv/bin/pip" install --quiet torch==2.13.0
    "$venv/bin/pip" install --quiet -e "$repo[test]" "transformers==$version"
    touch "$venv/.complete"
fi

# The editable install points at the checkout that built the environment: re-point it at this one.
where="$(cd /tmp && "$venv/bin/python" -c 'import nnterp, os; print(os.path.dirname(os.path.dirname(os.path.realpath(nnterp.__file__))))' 2>/dev/null || true)"
if [[ "$where" != "$repo" ]]; then
    "$venv/bin/pip" install --quiet --no-deps -e "$repo"
fi

installed="$("$venv/bin/python" -c 'import transformers; print(transformers.__version__)')"
if [[ "$installed" != "$version" ]]; then
    echo "the environment $venv has transformers $installed, not $version: delete it and rerun" >&2
    exit 2
fi

cd "$repo"
# Without a test path among the pytest args, run the default suites.
paths=0
for arg in "$@"; do
    [[ "$arg" != -* && -e "${arg%%::*}" ]] && paths=1
done
if [[ $paths -eq 0 ]]; then
    set -- "$@" tests/test_contract.py tests/components tests/families tests/recurrent tests/fast tests/reference tests/test_long_context.py
fi
echo "== transformers $installed: pytest $*" >&2
exec "$venv/bin/python" -m pytest "$@"
