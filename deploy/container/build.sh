#!/usr/bin/env bash
# Builds the container images of the three binaries from this checkout:
#
# 1. the binaries, statically linked against glibc (`-C target-feature=+crt-static` for
#    the host's x86_64-unknown-linux-gnu target; no musl toolchain needed), release
#    profile (PROFILE=dev for a quick build), and checks with ldd that they are static;
# 2. the build context in $OUT/context: a root filesystem skeleton (non-root user 65532,
#    CA certificates) and the binaries, next to deploy/container/Containerfile;
# 3. one image per binary with Debian's buildah (installed with apt-get when missing and
#    apt-get is there; podman is used instead when it is present and buildah is not):
#    localhost/relay-agent:$TAG, localhost/relay-tunnel-server:$TAG,
#    localhost/relay-dispatcher:$TAG, each also saved as $OUT/<binary>.oci.tar
#    (`podman load -i`, `skopeo copy oci-archive:...`);
# 4. each image's root filesystem exported to $OUT/rootfs/<binary>/ and
#    $OUT/<binary>-rootfs.tar, which deploy/container/check.sh runs the binaries from.
#
# Without buildah or podman (or when the image build fails, e.g. in a sandbox without the
# kernel features it needs) steps 1, 2 and 4 still run: the root filesystem is then the
# context assembled as the Containerfile would, and the script says so.
#
# Variables: OUT (default $CARGO_TARGET_DIR/container, or target/container), PROFILE (release), TAG (the workspace
# version), STORAGE_DRIVER (vfs: works anywhere, as root or in a container), NO_INSTALL=1
# (never apt-get), IMAGE_TOOL (buildah, podman or none; default: whichever is there),
# CARGO_TARGET_DIR (honoured).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT="$PWD"

BINARIES=(relay-agent relay-tunnel-server relay-dispatcher)
OUT="${OUT:-${CARGO_TARGET_DIR:-$ROOT/target}/container}"
PROFILE="${PROFILE:-release}"
VERSION="$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n 1)"
TAG="${TAG:-$VERSION}"
STORAGE_DRIVER="${STORAGE_DRIVER:-vfs}"
TARGET="$(rustc -vV | sed -n 's/^host: //p')"
case "$TARGET" in
  *-linux-gnu) ;;
  *) echo "build.sh: static glibc builds need a *-linux-gnu host; this one is $TARGET" >&2; exit 1 ;;
esac
PROFILE_DIR="$PROFILE"
[ "$PROFILE" = dev ] && PROFILE_DIR=debug
BIN_DIR="${CARGO_TARGET_DIR:-$ROOT/target}/$TARGET/$PROFILE_DIR"

echo "== static binaries ($PROFILE, $TARGET, +crt-static)"
bins=()
for b in "${BINARIES[@]}"; do bins+=(--bin "$b"); done
RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+crt-static" \
  cargo build --locked --profile "$PROFILE" --target "$TARGET" "${bins[@]}"
for b in "${BINARIES[@]}"; do
  # glibc's ldd says "not a dynamic executable" for a static binary; some versions say
  # "statically linked".
  verdict="$(ldd "$BIN_DIR/$b" 2>&1 || true)"
  case "$verdict" in
    *"not a dynamic executable"* | *"statically linked"*) echo "$b: static ($(echo "$verdict" | tr -d '\t'))" ;;
    *) echo "build.sh: $BIN_DIR/$b is not static: $verdict" >&2; exit 1 ;;
  esac
done

echo "== build context $OUT/context"
rm -rf "$OUT/context" "$OUT/rootfs"
mkdir -p "$OUT/context/bin" "$OUT/context/rootfs/etc/ssl/certs" "$OUT/rootfs"
cp deploy/container/Containerfile "$OUT/context/Containerfile"
for b in "${BINARIES[@]}"; do
  install -m 0755 "$BIN_DIR/$b" "$OUT/context/bin/$b"
  # The release profile keeps line tables (40-55 MB a binary); the images carry symbols
  # without them (about 10 MB): a panic's backtrace names functions, not lines.
  if command -v strip >/dev/null 2>&1; then strip --strip-debug "$OUT/context/bin/$b"; fi
done
R="$OUT/context/rootfs"
printf 'root:x:0:0:root:/:/sbin/nologin\nrelay:x:65532:65532:relay:/:/sbin/nologin\n' >"$R/etc/passwd"
printf 'root:x:0:\nrelay:x:65532:\n' >"$R/etc/group"
# Host names from /etc/hosts first, then DNS (glibc's built-in files and dns sources; a
# static binary loads no NSS module).
printf 'hosts: files dns\n' >"$R/etc/nsswitch.conf"
CA=/etc/ssl/certs/ca-certificates.crt
if [ ! -f "$CA" ]; then
  echo "build.sh: $CA missing (Debian package ca-certificates): the images need it for TLS to public CAs" >&2
  exit 1
fi
install -m 0644 "$CA" "$R/etc/ssl/certs/ca-certificates.crt"
chmod 0644 "$R/etc/passwd" "$R/etc/group" "$R/etc/nsswitch.conf"

# The image tool: buildah, else podman; apt-get installs buildah when neither is there.
TOOL="${IMAGE_TOOL:-}"
if [ "$TOOL" = none ]; then
  TOOL=""
elif [ -n "$TOOL" ]; then
  command -v "$TOOL" >/dev/null 2>&1 || { echo "build.sh: IMAGE_TOOL=$TOOL is not installed" >&2; exit 1; }
elif command -v buildah >/dev/null 2>&1; then
  TOOL=buildah
elif command -v podman >/dev/null 2>&1; then
  TOOL=podman
elif [ "${NO_INSTALL:-}" != 1 ] && command -v apt-get >/dev/null 2>&1; then
  echo "== installing buildah (apt-get)"
  SUDO=""
  [ "$(id -u)" != 0 ] && SUDO=sudo
  if $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends buildah; then
    TOOL=buildah
  fi
fi

built=0
if [ -n "$TOOL" ]; then
  echo "== images ($TOOL, storage driver $STORAGE_DRIVER)"
  built=1
  for b in "${BINARIES[@]}"; do
    if [ "$TOOL" = buildah ]; then
      build=(buildah --storage-driver "$STORAGE_DRIVER" build --isolation chroot)
    else
      build=(podman --storage-driver "$STORAGE_DRIVER" build --isolation chroot)
    fi
    if ! "${build[@]}" --quiet --target "$b" --build-arg "VERSION=$VERSION" \
      -t "localhost/$b:$TAG" -f "$OUT/context/Containerfile" "$OUT/context"; then
      echo "build.sh: $TOOL could not build $b" >&2
      built=0
      break
    fi
    rm -f "$OUT/$b.oci.tar"
    $TOOL --storage-driver "$STORAGE_DRIVER" push --quiet "localhost/$b:$TAG" "oci-archive:$OUT/$b.oci.tar:localhost/$b:$TAG"
    # Export the image's root filesystem.
    mkdir -p "$OUT/rootfs/$b"
    if [ "$TOOL" = buildah ]; then
      ctr="$(buildah --storage-driver "$STORAGE_DRIVER" from --pull-never "localhost/$b:$TAG")"
      mnt="$(buildah --storage-driver "$STORAGE_DRIVER" mount "$ctr")"
      cp -a "$mnt/." "$OUT/rootfs/$b/"
      buildah --storage-driver "$STORAGE_DRIVER" umount "$ctr" >/dev/null
      buildah --storage-driver "$STORAGE_DRIVER" rm "$ctr" >/dev/null
    else
      ctr="$(podman --storage-driver "$STORAGE_DRIVER" create "localhost/$b:$TAG")"
      podman --storage-driver "$STORAGE_DRIVER" export "$ctr" | tar -C "$OUT/rootfs/$b" -xf -
      podman --storage-driver "$STORAGE_DRIVER" rm "$ctr" >/dev/null
    fi
    echo "localhost/$b:$TAG  ($OUT/$b.oci.tar)"
  done
fi
if [ "$built" != 1 ]; then
  echo "== NO IMAGE BUILT (no buildah or podman, or its build failed): assembling each root filesystem from the context as the Containerfile does"
  for b in "${BINARIES[@]}"; do
    rm -rf "$OUT/rootfs/$b"
    mkdir -p "$OUT/rootfs/$b/usr/local/bin"
    cp -a "$OUT/context/rootfs/." "$OUT/rootfs/$b/"
    install -m 0755 "$OUT/context/bin/$b" "$OUT/rootfs/$b/usr/local/bin/$b"
  done
fi
for b in "${BINARIES[@]}"; do
  tar -C "$OUT/rootfs/$b" --numeric-owner -cf "$OUT/$b-rootfs.tar" .
done
echo "== root filesystems: $OUT/rootfs/<binary>/ and $OUT/<binary>-rootfs.tar"
echo "deploy/container/build.sh: done (images built: $([ "$built" = 1 ] && echo yes || echo no)); check them with deploy/container/check.sh"
