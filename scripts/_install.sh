# Sourced by scripts/test and scripts/demo: make .venv and install queueserve with the extras
# named in $QS_EXTRAS (constraints.txt pins torch to the CPU build on disk here). Reinstalls
# only when the install inputs change: the install is editable, so code edits need none.
say() { printf '==> %s\n' "$*"; }

apt_install() {  # Debian packages, as root (through sudo when not root)
    local sudo=""
    if [[ "$(id -u)" -ne 0 ]]; then sudo="sudo"; fi
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null
}

if [[ ! -x .venv/bin/python ]]; then
    say "creating .venv"
    if ! python3 -m venv .venv; then
        # Debian's python3 ships venv without ensurepip: python3-venv brings it
        say "installing python3-venv (apt-get)"
        rm -rf .venv
        apt_install python3-venv
        python3 -m venv .venv
    fi
fi
PY=.venv/bin/python

stamp=.venv/.queueserve-install-${QS_EXTRAS//,/-}
want="$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)"
if [[ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]]; then
    say "installing -e .[$QS_EXTRAS] (constraints.txt)"
    "$PY" -m pip install -qq --disable-pip-version-check -c constraints.txt -e ".[$QS_EXTRAS]"
    echo "$want" >"$stamp"
else
    say "install up to date (.venv)"
fi

ensure_redis_server() {
    # redis-cli too: the Redis Cluster tests join their nodes with `redis-cli --cluster create`
    if command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1; then
        return
    fi
    say "installing redis-server (apt-get)"
    apt_install redis-server
    command -v redis-server >/dev/null && command -v redis-cli >/dev/null || {
        echo "error: redis-server or redis-cli still not found" >&2; exit 1; }
}

ensure_chromium() {
    # tests/integration/test_dashboard.py drives the dashboard's page in a headless Chromium
    if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
        return
    fi
    say "installing chromium and chromium-driver (apt-get)"
    apt_install chromium chromium-driver
    command -v chromium >/dev/null && command -v chromedriver >/dev/null || {
        echo "error: chromium or chromedriver still not found" >&2; exit 1; }
}

ensure_prometheus() {
    # tests/integration/test_grafana.py runs deploy/grafana/queueserve.json's queries against
    # a real Prometheus scraping a worker
    if command -v prometheus >/dev/null 2>&1; then
        return
    fi
    say "installing prometheus (apt-get)"
    apt_install prometheus
    command -v prometheus >/dev/null || {
        echo "error: prometheus still not found" >&2; exit 1; }
}
