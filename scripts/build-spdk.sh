#!/usr/bin/env bash
# Builds SPDK from a source tarball the way ../shared/spdk/README.md describes, and installs it
# under PREFIX (libraries, headers, pkg-config files and the nvmf_tgt app the tests use).
#
#   scripts/build-spdk.sh SRC_TARBALL PATCH PREFIX
#
# SRC_TARBALL  `git archive` of spdk/spdk (e.g. ../shared/spdk/spdk-3230130e6a.tar.xz)
# PATCH        patch applied with `patch -p1` inside the tree (the Debian 12 DPDK/ISA-L patch);
#              pass an empty string for none
# PREFIX       install prefix; the teraio engine's `spdk` feature finds SPDK through
#              PKG_CONFIG_PATH=PREFIX/lib/pkgconfig
#
# Idempotent: PREFIX/.teraio-spdk-stamp records the sha256 of the tarball, the patch and the
# build recipe below; a second call with the same inputs returns at once (this is CI's cache).
# Needs the Debian packages listed in docs/SPDK.md (.ci/spdk.sh installs them).
# JOBS (default 2) sets make's parallelism.
set -euo pipefail

if [ $# -ne 3 ]; then
    echo "usage: $0 SRC_TARBALL PATCH PREFIX" >&2
    exit 2
fi
src_tarball=$1
patch_file=$2
prefix=$3
jobs=${JOBS:-2}

[ -f "$src_tarball" ] || { echo "build-spdk: source tarball not found: $src_tarball" >&2; exit 1; }
if [ -n "$patch_file" ] && [ ! -f "$patch_file" ]; then
    echo "build-spdk: patch not found: $patch_file" >&2
    exit 1
fi
for tool in make gcc pkg-config patch tar python3; do
    command -v "$tool" >/dev/null || { echo "build-spdk: '$tool' not found (see docs/SPDK.md for the packages)" >&2; exit 1; }
done
pkg-config --exists libdpdk || { echo "build-spdk: DPDK not found by pkg-config (apt-get install libdpdk-dev)" >&2; exit 1; }

# The recipe: change this list (or anything below that shapes the build) and bump RECIPE so
# cached prefixes are rebuilt.
RECIPE=1
configure_flags=(--with-dpdk --with-shared --with-isal --without-isal-crypto --without-crypto
    --without-vhost --without-virtio --without-fsdev --without-nvme-cuse --without-xnvme
    --without-ocf --without-vfio-user --without-rdma --without-iscsi-initiator --without-usdt
    --without-idxd --with-uring --disable-tests --disable-unit-tests)

mkdir -p "$prefix"
prefix=$(cd "$prefix" && pwd)
stamp="$prefix/.teraio-spdk-stamp"
key=$( {
    sha256sum < "$src_tarball"
    if [ -n "$patch_file" ]; then sha256sum < "$patch_file"; else echo "no patch"; fi
    echo "recipe $RECIPE ${configure_flags[*]}"
} | sha256sum | cut -d' ' -f1)

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ] && [ -f "$prefix/lib/pkgconfig/spdk_nvme.pc" ]; then
    echo "build-spdk: $prefix is up to date (key $key)"
    exit 0
fi

echo "build-spdk: building SPDK into $prefix (key $key, make -j$jobs)"
rm -f "$stamp"
work=$(mktemp -d "${TMPDIR:-/tmp}/teraio-spdk-build.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir "$work/spdk"
tar xJf "$src_tarball" -C "$work/spdk"
cd "$work/spdk"
if [ -n "$patch_file" ]; then
    patch -p1 --forward < "$patch_file"
fi
./configure --prefix="$prefix" "${configure_flags[@]}"
# Debian's DPDK pulls in intel-ipsec-mb otherwise.
sed -i 's/^CONFIG_IPSEC_MB?=y/CONFIG_IPSEC_MB?=n/' mk/config.mk
# SPDK's build scripts need the system python3 (tabulate, jinja2, yaml), not a venv's.
PATH=/usr/bin:$PATH make -j"$jobs"
# `make install` would also install SPDK's Python package (needs uv, and the backend does
# not use it): install the C parts only.
for dir in lib module shared_lib include app; do
    PATH=/usr/bin:$PATH make -C "$dir" install
done
# nvmf_tgt serves the NVMe/TCP loopback target in the tests; make install puts it in bin/.
[ -x "$prefix/bin/nvmf_tgt" ] || install -m 0755 build/bin/nvmf_tgt "$prefix/bin/nvmf_tgt"
[ -f "$prefix/lib/pkgconfig/spdk_nvme.pc" ] || { echo "build-spdk: install left no spdk_nvme.pc in $prefix/lib/pkgconfig" >&2; exit 1; }
echo "$key" > "$stamp"
echo "build-spdk: done: PKG_CONFIG_PATH=$prefix/lib/pkgconfig"
