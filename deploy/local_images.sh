#!/usr/bin/env bash
# A base image made from Debian's packages, for a machine that reaches no image registry (CI
# here): Debian bookworm (minbase) with Python 3.11, pip, bubblewrap and redis-server, made with
# debootstrap and imported into the local engine. It stands in for python:3.11-slim (build
# --build-arg BASE_IMAGE=...) and for redis:7.2 (working_dir /data). Prints the image's name,
# tagged by a hash of what it is made of: a rerun finds it and does nothing. It trusts the
# certificate authorities this machine adds to Debian's (/usr/local/share/ca-certificates: a
# proxy's, say), so its apt and pip reach what this machine's reach.
#   BASE=$(deploy/local_images.sh)
set -euo pipefail
suite=bookworm
packages=python3,python3-pip,python-is-python3,ca-certificates,bubblewrap,redis-server
changes=('ENV PIP_BREAK_SYSTEM_PACKAGES=1' 'CMD ["bash"]')
local_cas=$(find /usr/local/share/ca-certificates -name '*.crt' 2>/dev/null | sort)
recipe=$(echo "$packages ${changes[*]}"; [ -z "$local_cas" ] || cat $local_cas)
image=opentinker-local/base:$suite-$(echo "$recipe" | sha256sum | cut -c1-12)
if ! docker image inspect "$image" >/dev/null 2>&1; then
  root=$(mktemp -d)
  trap 'rm -rf "$root"' EXIT
  debootstrap --variant=minbase --include="$packages" "$suite" "$root" >&2
  if [ -n "$local_cas" ]; then
    cp $local_cas "$root/usr/local/share/ca-certificates/"
    chroot "$root" update-ca-certificates >&2
  fi
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb
  # Debian marks its Python as managed by apt (PEP 668); the image's pip installs beside it.
  tar -C "$root" -c . | docker import --change "${changes[0]}" --change "${changes[1]}" - "$image" >&2
fi
echo "$image"
