# shellcheck shell=bash
# Sourced by scripts/demo and scripts/test: make the virtual environment "$S3DCP_VENV" (default
# .venv in the checkout) hold torch and this checkout (editable) with the extras "$1", doing only
# what is missing. A stamp in the venv records what was installed (pyproject.toml's hash, the
# torch requirement and index, the extras); while it matches, nothing is installed again, so a
# second run starts at once. Code edits need no reinstall (the install is editable).
#
#   S3DCP_VENV       the environment's directory (default .venv)
#   PYTHON           the interpreter that creates it (default python3; Python >= 3.10)
#   TORCH_SPEC       the torch requirement (default torch==2.13.0)
#   TORCH_INDEX_URL  the index torch comes from; unset: pip's configured index (on Linux PyPI's
#                    torch is the multi-GB CUDA build: https://download.pytorch.org/whl/cpu is
#                    the CPU one)

s3dcp_env() {
    local extras=$1
    local root venv stamp want
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    venv=${S3DCP_VENV:-$root/.venv}
    TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
    if [ ! -x "$venv/bin/python" ]; then
        echo "# creating the virtual environment $venv" >&2
        "${PYTHON:-python3}" -m venv "$venv"
        "$venv/bin/python" -m pip install -q --upgrade pip
    fi
    # The stamp: "<pyproject.toml's sha256> <torch requirement> <torch index>" on its first line,
    # the extras installed so far on the second (demo's and test's accumulate, so that running
    # one after the other installs nothing twice).
    stamp=$venv/.s3dcp-installed
    want="$("$venv/bin/python" -c 'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())' "$root/pyproject.toml") $TORCH_SPEC ${TORCH_INDEX_URL:-} editable=compat"
    local have="" have_extras="" e missing=""
    if [ -f "$stamp" ]; then
        have=$(sed -n 1p "$stamp")
        have_extras=$(sed -n 2p "$stamp")
    fi
    [ "$have" = "$want" ] || have_extras=""
    for e in ${extras//,/ }; do
        case ",$have_extras," in *",$e,"*) ;; *) missing="$missing,$e" ;; esac
    done
    if [ -z "$have_extras" ] || [ -n "$missing" ]; then
        extras=${have_extras:+$have_extras,}${missing#,}
        echo "# installing $TORCH_SPEC${TORCH_INDEX_URL:+ from $TORCH_INDEX_URL}, then s3dcp[$extras] (editable) into $venv" >&2
        rm -f "$stamp"
        # torch first, on its own, so that its index (when given) serves only torch; then the
        # package with the same torch requirement, so that pip keeps that build. A torch
        # requirement or index other than the stamp's replaces the installed torch (pip would
        # keep a build that satisfies the version, e.g. the CUDA one when the CPU one is asked).
        local force=()
        if [ -n "$have" ] && [ "${have#* }" != "${want#* }" ]; then
            force=(--force-reinstall --no-deps)
        fi
        "$venv/bin/python" -m pip install -q ${force[@]+"${force[@]}"} "$TORCH_SPEC" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
        # editable_mode=compat: the clone on sys.path (a .pth), so `import s3dcp` finds this
        # package also from the folder holding a clone named s3dcp (with setuptools' default
        # import hook, that clone folder is found first, as an empty namespace package)
        "$venv/bin/python" -m pip install -q "$TORCH_SPEC" -e "$root[$extras]" --config-settings editable_mode=compat
        printf '%s\n%s\n' "$want" "$extras" >"$stamp"
    fi
    S3DCP_ROOT=$root
    S3DCP_PYTHON=$venv/bin/python
}
