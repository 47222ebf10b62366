# Shared by scripts/setup and scripts/install (sourced, not run).

# Install the named Debian packages that are missing: as root with apt-get, otherwise fail
# with one line naming them. $1 is the calling script's name, for messages.
ensure_debian_packages() {
    local who=$1 p
    shift
    local missing=()
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
    done
    ((${#missing[@]})) || return 0
    if [[ $(id -u) -ne 0 ]]; then
        echo "$who: missing Debian packages: ${missing[*]} (run as root, or: sudo apt-get install ${missing[*]})" >&2
        return 1
    fi
    echo "$who: installing ${missing[*]}" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# The Python interpreter to build virtual environments from ($PYTHON, else python3), checked
# to be new enough; its name on stdout.
python_for_venv() {
    local who=$1 python=${PYTHON:-python3}
    if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
        echo "$who: modelfs needs Python 3.11 or newer ($python is $("$python" -V 2>&1))" >&2
        return 1
    fi
    echo "$python"
}

# FUSE passthrough in the virtualenv $2 (scripts/build-passthrough; ~45 s once, nothing after),
# unless MODELFS_SKIP_PASSTHROUGH=1. Failing to build it is a warning: the mount then serves
# reads itself. MODELFS_REQUIRE_PASSTHROUGH=1 makes it an error (CI).
build_passthrough() {
    local who=$1 venv=$2
    [[ ${MODELFS_SKIP_PASSTHROUGH:-0} != 1 ]] || return 0
    if ! "$venv/bin/python" "$(dirname "${BASH_SOURCE[0]}")/../build-passthrough" --venv "$venv"; then
        if [[ ${MODELFS_REQUIRE_PASSTHROUGH:-0} == 1 ]]; then
            echo "$who: FUSE passthrough could not be built" >&2
            return 1
        fi
        echo "$who: FUSE passthrough not built; the mount will serve reads itself" >&2
    fi
}
