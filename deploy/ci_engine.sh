#!/usr/bin/env bash
# A container engine for tests/project/test_compose_stack.py on a Debian machine where we are root (CI):
# Debian's docker.io and debootstrap, the compose v2 plugin, and dockerd started when none
# answers. Exits non-zero saying why when any of it fails; the test then skips, saying why.
#   bash deploy/ci_engine.sh
set -euo pipefail

if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "not root with apt-get: no container engine installed"
  exit 1
fi

apt_install() {
  apt-get install -y -q "$@" >/dev/null 2>&1 \
    || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "$@" >/dev/null 2>&1)
}

need=()
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
  apt_install "${need[@]}" || { echo "apt-get could not install ${need[*]}"; exit 1; }
fi

# Compose v2: Debian 13's docker-compose package is it; Debian 12's is compose v1 (Python),
# which reads none of compose.yaml's `!reset`. There only the plugin binary of Debian 13's
# package is taken (a Go program needing libc6 >= 2.34; Debian 12 has 2.36), downloaded by apt
# with a state folder of its own, so the machine's sources and packages stay as they are.
plugin=/usr/local/lib/docker/cli-plugins/docker-compose
if ! docker compose version --short 2>/dev/null | grep -q '^v\?2\.'; then
  if apt-cache policy docker-compose 2>/dev/null | grep -q 'Candidate: 2\.'; then
    apt_install docker-compose || { echo "apt-get could not install docker-compose"; exit 1; }
  else
    state=$(mktemp -d)
    trap 'rm -rf "$state"' EXIT
    mkdir -p "$state/lists/partial" "$state/cache/archives/partial"
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg]" \
      "http://deb.debian.org/debian trixie main" > "$state/sources.list"
    apt_opts=(-o "Dir::Etc::SourceList=$state/sources.list" -o Dir::Etc::SourceParts=/dev/null
      -o "Dir::State::Lists=$state/lists" -o "Dir::Cache=$state/cache")
    apt-get "${apt_opts[@]}" update -q >/dev/null 2>&1 || { echo "apt-get update (trixie) failed"; exit 1; }
    (cd "$state" && apt-get "${apt_opts[@]}" download docker-compose >/dev/null 2>&1) \
      || { echo "apt-get could not download Debian 13's docker-compose"; exit 1; }
    dpkg -x "$state"/docker-compose_*.deb "$state/x"
    install -D -m 0755 "$state/x/usr/libexec/docker/cli-plugins/docker-compose" "$plugin"
  fi
fi
docker compose version

# The engine: overlay2 where the kernel allows it, vfs (slow, but it runs) where not.
if ! docker info >/dev/null 2>&1; then
  for driver in overlay2 vfs; do
    nohup dockerd --storage-driver "$driver" >"/var/log/dockerd-$driver.log" 2>&1 &
    pid=$!
    for _ in $(seq 30); do
      docker info >/dev/null 2>&1 && break 2
      kill -0 "$pid" 2>/dev/null || break
      sleep 1
    done
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    echo "dockerd did not start with $driver: $(tail -n 2 "/var/log/dockerd-$driver.log")"
  done
fi
docker info --format 'container engine {{.ServerVersion}}, storage {{.Driver}}' \
  || { echo "no container engine answers"; exit 1; }
