#!/usr/bin/env bash
# Builds a distroless-style root filesystem for one dynamically linked binary:
#   ROOTFS/usr/local/bin/<binary>, its ELF interpreter and every shared library it loads (as
#   ldd resolves them, at the same paths), /etc/passwd and /etc/group with root and nonroot
#   (65532), /etc/nsswitch.conf, and a sticky /tmp. Used by images/sidecar/Dockerfile and by
#   `make image-steps-sidecar`.
#
#   images/sidecar/collect-rootfs.sh BINARY ROOTFS
set -euo pipefail
bin="$1"
root="$2"
[ -x "$bin" ] || { echo "collect-rootfs: $bin is not an executable" >&2; exit 1; }
rm -rf "$root"
mkdir -p "$root/usr/local/bin" "$root/etc" "$root/tmp"
chmod 1777 "$root/tmp"
install -m 0755 "$bin" "$root/usr/local/bin/"
# ldd prints "libx.so => /path (0x...)" and "/lib64/ld-linux-x86-64.so.2 (0x...)"; the vDSO has no path.
ldd "$bin" | grep -o '/[^ )]*' | sort -u | while read -r lib; do
  mkdir -p "$root$(dirname "$lib")"
  cp -L "$lib" "$root$lib"
done
cat > "$root/etc/passwd" <<'PASSWD'
root:x:0:0:root:/root:/sbin/nologin
nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin
PASSWD
cat > "$root/etc/group" <<'GROUP'
root:x:0:
nonroot:x:65532:
GROUP
# Since glibc 2.34 the files and dns NSS modules are built into libc: no plugins to copy.
echo 'hosts: files dns' > "$root/etc/nsswitch.conf"
echo "collect-rootfs: $(find "$root" -type f | wc -l) files, $(du -sh "$root" | cut -f1) in $root"
