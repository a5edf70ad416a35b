#!/usr/bin/env bash
# A local stand-in for python:3.11-slim-bookworm, for machines that cannot pull from Docker Hub.
#
#   scripts/image_base.sh TOOL IMAGE      (TOOL: docker, podman or buildah; run as root)
#
# Makes a Debian bookworm root filesystem with debootstrap from a Debian mirror (DEBIAN_MIRROR,
# default http://deb.debian.org/debian), with python3 (3.11), python3-venv, `python` and the CA
# certificates, brings it up to date from bookworm-updates and bookworm-security, and imports it as
# IMAGE (FROM scratch + the root filesystem as a tar). The Dockerfile's PYTHON_IMAGE build-arg then
# points at it; its steps need only `python` with venv and pip, groupadd/useradd and ldconfig.
#
# Cached: IMAGE carries a label with a hash of this script and the mirror; while an image with that
# label exists, nothing is done (a second run takes a second). Delete the image to rebuild it.
set -euo pipefail

tool=${1:?usage: image_base.sh TOOL IMAGE}
image=${2:?usage: image_base.sh TOOL IMAGE}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
suite=bookworm
here=$(cd "$(dirname "$0")" && pwd)
key=$( (cat "$here/image_base.sh"; echo "$mirror $suite") | sha256sum | cut -c1-16)
label=io.kv-sidecar.base-key

if [ "$tool" = buildah ]; then
    have=$(buildah inspect --type image --format "{{ index .OCIv1.Config.Labels \"$label\" }}" "$image" 2>/dev/null || true)
else
    have=$("$tool" image inspect --format "{{ index .Config.Labels \"$label\" }}" "$image" 2>/dev/null || true)
fi
if [ "$have" = "$key" ]; then
    echo "base image $image is up to date (key $key)"
    exit 0
fi

command -v debootstrap >/dev/null || {
    echo "image_base.sh: debootstrap is missing (Debian/Ubuntu: apt-get install debootstrap)" >&2
    exit 1
}
[ "$(id -u)" = 0 ] || { echo "image_base.sh: debootstrap needs root" >&2; exit 1; }

work=$(mktemp -d "${TMPDIR:-/var/tmp}/kv-sidecar-base.XXXXXX")
cleanup() {
    # debootstrap mounts /proc and /sys inside the target while it works; an interrupted run can
    # leave them there. Unmount before deleting, and never cross into another file system.
    findmnt -rn -o TARGET | grep -F "$work/" | sort -r | xargs -r -n1 umount -l 2>/dev/null || true
    rm -rf --one-file-system "$work"
}
trap cleanup EXIT
root=$work/rootfs
t0=$(date +%s)

echo "debootstrap $suite from $mirror into $root"
debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
    "$suite" "$root" "$mirror" >"$work/debootstrap.log" 2>&1 || {
    tail -30 "$work/debootstrap.log" >&2
    exit 1
}

# Point releases and security fixes, as the official image has them.
security=${DEBIAN_SECURITY_MIRROR:-${mirror%/debian}/debian-security}
cat >"$root/etc/apt/sources.list" <<EOF
deb $mirror $suite main
deb $mirror $suite-updates main
deb $security $suite-security main
EOF
cp /etc/resolv.conf "$root/etc/resolv.conf"
chroot "$root" apt-get -qq update
DEBIAN_FRONTEND=noninteractive chroot "$root" apt-get -qq -y upgrade >/dev/null
chroot "$root" apt-get -qq clean
# What an image does not need: package lists, caches, logs, docs (their copyright files stay).
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/debconf/*-old \
    "$root"/var/log/* "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/tmp/* "$root"/var/tmp/*
find "$root/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete
find "$root/usr/share/doc" -mindepth 1 -type d -empty -delete
: >"$root/etc/resolv.conf"
chroot "$root" python --version

tar --numeric-owner -C "$root" -cf "$work/rootfs.tar" .
cat >"$work/Containerfile" <<EOF
FROM scratch
ADD rootfs.tar /
ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
LABEL $label=$key \\
      org.opencontainers.image.description="Debian $suite (debootstrap) with python3.11: a local stand-in for python:3.11-slim-$suite"
CMD ["python3"]
EOF
build=(build)
[ "$tool" = docker ] || build+=(--isolation "${BUILDAH_ISOLATION:-chroot}")
"$tool" "${build[@]}" -t "$image" -f "$work/Containerfile" "$work" >"$work/build.log" 2>&1 || {
    tail -30 "$work/build.log" >&2
    exit 1
}
echo "base image $image built in $(($(date +%s) - t0)) s (key $key)"
