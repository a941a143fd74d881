#!/usr/bin/env bash
# CI: the SPDK backend. Installs SPDK's build dependencies, builds SPDK from the snapshot in
# ../shared/spdk (cached per tarball+patch+recipe under ~/.cache/teraio-spdk), then runs the
# engine's tests with the `spdk` feature: the conformance suite on SPDK bdevs, aio+bounce and
# SPDK's NVMe driver over NVMe/TCP loopback, the store stress test and the spdk tests.
#
#   TERAIO_SPDK_TARBALL  (default ../shared/spdk/spdk-3230130e6a.tar.xz next to the clone)
#   TERAIO_SPDK_PATCH    (default ../shared/spdk/debian12-dpdk2211.patch)
#   TERAIO_SPDK_CACHE    (default ~/.cache/teraio-spdk)
# Missing inputs fail loudly: nothing is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
shared=${TERAIO_SHARED:-$root/../shared}
tarball=${TERAIO_SPDK_TARBALL:-$shared/spdk/spdk-3230130e6a.tar.xz}
patch=${TERAIO_SPDK_PATCH:-$shared/spdk/debian12-dpdk2211.patch}
cache=${TERAIO_SPDK_CACHE:-$HOME/.cache/teraio-spdk}
for f in "$tarball" "$patch"; do
    [ -f "$f" ] || { echo "spdk.sh: $f not found (set TERAIO_SPDK_TARBALL / TERAIO_SPDK_PATCH)" >&2; exit 1; }
done

pkgs="gcc g++ make pkgconf patch libdpdk-dev libisal-dev libnuma-dev libaio-dev liburing-dev uuid-dev
libssl-dev libjson-c-dev libcunit1-dev libncurses-dev libcmocka-dev libkeyutils-dev meson
ninja-build nasm python3-pyelftools python3-tabulate python3-jinja2 python3-yaml clang libclang-dev
util-linux"
missing=$(for p in $pkgs; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
if [ -n "$missing" ]; then
    echo "spdk.sh: installing $(echo $missing)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
fi

key=$(cat "$tarball" "$patch" scripts/build-spdk.sh | sha256sum | cut -c1-16)
prefix=$cache/$key
scripts/build-spdk.sh "$tarball" "$patch" "$prefix"

export PKG_CONFIG_PATH=$prefix/lib/pkgconfig
# One test binary at a time with two test threads: every SPDK test process polls with its own
# threads, and the NVMe/TCP target takes a core of its own.
cargo test -p teraio-engine --features spdk --locked \
    --test io_conformance --test spdk --test store_files_stress -- --test-threads 2
