#!/usr/bin/env bash
# Make a Debian bookworm base image without a container registry:
#   debootstrap (from the Debian mirror apt uses here) -> tar -> `docker import`.
#   bash scripts/make_local_base.sh [IMAGE]          # default local/debian:bookworm
# The Dockerfiles take it as their BASE_IMAGE build argument (docs/deploy.md). Does nothing when IMAGE exists.
# Needs root, debootstrap and a running docker engine.
set -euo pipefail
image=${1:-local/debian:bookworm}
docker=${DOCKER:-docker}
if "$docker" image inspect "$image" >/dev/null 2>&1; then
  echo "base image $image: present"
  exit 0
fi
# The mirror apt already uses (deb822 sources first, then the one-line format); deb.debian.org otherwise.
mirror=$(grep -hoE '^URIs: *[^ ]+/debian/?$' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1 | awk '{print $2}' || true)
if [ -z "$mirror" ]; then
  mirror=$(grep -hoE '^deb +[^ ]+/debian/? +bookworm' /etc/apt/sources.list 2>/dev/null | head -1 | awk '{print $2}' || true)
fi
mirror=${mirror:-http://deb.debian.org/debian}
rootfs=$(mktemp -d /tmp/specdec-rootfs.XXXXXX)
trap 'rm -rf "$rootfs"' EXIT
echo "debootstrap bookworm from $mirror"
debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >/dev/null
# Security updates too, as python:3.11-slim users would have them; apt lists are dropped from the image.
cat > "$rootfs/etc/apt/sources.list" <<SOURCES
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb ${mirror%/debian*}/debian-security bookworm-security main
SOURCES
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
tar -C "$rootfs" -c . | "$docker" import -c 'CMD ["bash"]' -c 'ENV LANG=C.UTF-8' - "$image" >/dev/null
echo "base image $image: imported"
