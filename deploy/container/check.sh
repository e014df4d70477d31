#!/usr/bin/env bash
# Checks the root filesystems deploy/container/build.sh exported ($OUT/rootfs/<binary>/,
# default target/container), as root (chroot):
#
# 1. each image holds its binary, the non-root user, CA certificates and nothing else (no
#    shell); `ldd` says the binary is static;
# 2. the binary runs from the exported root filesystem as user 65532: `--version`;
# 3. the local example (examples/local's configs, each loopback port moved up by
#    PORT_OFFSET, default 20000, so that it runs beside a local example already running)
#    runs from them: two tunnel servers, the dispatcher and the agent, each in its own
#    root filesystem with the example mounted at /examples/local (copied in), a sample
#    upstream (python3's http.server); a call through the dispatcher answers with the
#    upstream's file, `relay-agent check` passes and `relay-agent diag` writes its
#    archive; SIGTERM stops each process with exit status 0.
# When buildah is there and the images were built, it also runs `--version` in each
# image itself (buildah run, chroot isolation).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT="$PWD"
OUT="${OUT:-${CARGO_TARGET_DIR:-$ROOT/target}/container}"
STORAGE_DRIVER="${STORAGE_DRIVER:-vfs}"
VERSION="$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n 1)"
TAG="${TAG:-$VERSION}"
BINARIES=(relay-agent relay-tunnel-server relay-dispatcher)
[ "$(id -u)" = 0 ] || { echo "check.sh: chroot needs root" >&2; exit 1; }

fail() { echo "FAIL: $*" >&2; exit 1; }

for b in "${BINARIES[@]}"; do
  r="$OUT/rootfs/$b"
  [ -x "$r/usr/local/bin/$b" ] || fail "$r/usr/local/bin/$b missing: run deploy/container/build.sh first"
  files="$(cd "$r" && find . -type f -o -type l | sort | tr '\n' ' ')"
  want="./etc/group ./etc/nsswitch.conf ./etc/passwd ./etc/ssl/certs/ca-certificates.crt ./usr/local/bin/$b "
  [ "$files" = "$want" ] || fail "$b: the image holds [$files], expected [$want]"
  verdict="$(ldd "$r/usr/local/bin/$b" 2>&1 || true)"
  case "$verdict" in
    *"not a dynamic executable"* | *"statically linked"*) ;;
    *) fail "$b is not static: $verdict" ;;
  esac
  v="$(chroot --userspec=65532:65532 "$r" "/usr/local/bin/$b" --version)"
  [ "$v" = "$b $VERSION" ] || fail "$b --version printed '$v'"
  echo "ok   $b: static ($(echo "$verdict" | tr -d '\t')), no shell, runs as 65532: $v"
  if command -v buildah >/dev/null 2>&1 && buildah --storage-driver "$STORAGE_DRIVER" inspect "localhost/$b:$TAG" >/dev/null 2>&1; then
    ctr="$(buildah --storage-driver "$STORAGE_DRIVER" from --pull-never "localhost/$b:$TAG")"
    v="$(buildah --storage-driver "$STORAGE_DRIVER" run --isolation chroot "$ctr" -- "/usr/local/bin/$b" --version)"
    user="$(buildah --storage-driver "$STORAGE_DRIVER" inspect --format '{{.OCIv1.Config.User}}' "localhost/$b:$TAG")"
    buildah --storage-driver "$STORAGE_DRIVER" rm "$ctr" >/dev/null
    [ "$v" = "$b $VERSION" ] || fail "image localhost/$b:$TAG: --version printed '$v'"
    [ "$user" = "65532:65532" ] || fail "image localhost/$b:$TAG runs as '$user'"
    echo "ok   image localhost/$b:$TAG: user $user, buildah run: $v"
  fi
done

OFFSET="${PORT_OFFSET:-20000}"
echo "== the local example from the exported root filesystems (ports + $OFFSET)"
WORK="$(mktemp -d)"
mkdir -p "$WORK/example"
cp examples/local/*.toml "$WORK/example/"
for port in 8000 8080 8460 9080 8441 8442 8451 8452 9441 9442 9090; do
  moved=$((port + OFFSET))
  if (exec 3<>"/dev/tcp/127.0.0.1/$moved") 2>/dev/null; then
    fail "port $moved is in use: set PORT_OFFSET to move the example's ports elsewhere"
  fi
  sed -i "s/127\.0\.0\.1:$port\b/127.0.0.1:$moved/g" "$WORK"/example/*.toml
done
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
# One writable copy of each root filesystem per process, the example "mounted" in it.
start() { # name binary config
  local name="$1" b="$2" cfg="$3"
  cp -a "$OUT/rootfs/$b" "$WORK/$name"
  mkdir -p "$WORK/$name/examples/local" "$WORK/$name/tmp"
  cp "$WORK"/example/*.toml "$WORK/$name/examples/local/"
  chmod 1777 "$WORK/$name/tmp"
  chroot --userspec=65532:65532 "$WORK/$name" "/usr/local/bin/$b" --config "/examples/local/$cfg" \
    >"$WORK/$name.log" 2>&1 &
  PIDS+=("$!")
  echo "$!" >"$WORK/$name.pid"
}
mkdir -p "$WORK/www"
echo "hello from the upstream" >"$WORK/www/hello"
python3 -m http.server $((8000 + OFFSET)) --bind 127.0.0.1 --directory "$WORK/www" >"$WORK/upstream.log" 2>&1 &
UPSTREAM="$!"
PIDS+=("$UPSTREAM")
start dispatcher relay-dispatcher dispatcher.toml
start ts-1 relay-tunnel-server tunnel-server-1.toml
start ts-2 relay-tunnel-server tunnel-server-2.toml
start agent relay-agent agent.toml

deadline=$((SECONDS + 30))
answer=""
until answer="$(curl -sf -H 'Authorization: Bearer dev-caller-key' "http://127.0.0.1:$((8080 + OFFSET))/relay/demo/hello")"; do
  if [ "$SECONDS" -ge "$deadline" ]; then
    for n in dispatcher ts-1 ts-2 agent; do echo "--- $n"; tail -n 5 "$WORK/$n.log"; done
    fail "no answer through the relay within 30 s"
  fi
  sleep 0.2
done
[ "$answer" = "hello from the upstream" ] || fail "the call answered '$answer'"
echo "ok   a call through the dispatcher, tunnel server and agent, each from its image's root filesystem: $answer"

chroot --userspec=65532:65532 "$WORK/agent" /usr/local/bin/relay-agent check --config /examples/local/agent.toml >"$WORK/check.txt" 2>&1 \
  || { cat "$WORK/check.txt"; fail "relay-agent check failed"; }
echo "ok   relay-agent check from the image: $(tail -n 1 "$WORK/check.txt")"
chroot --userspec=65532:65532 "$WORK/agent" /usr/local/bin/relay-agent diag --config /examples/local/agent.toml --output /tmp/diag.tar.gz 2>"$WORK/diag.txt" \
  || { cat "$WORK/diag.txt"; fail "relay-agent diag failed"; }
tar -tzf "$WORK/agent/tmp/diag.tar.gz" | grep -q 'relay-agent-diag/admin/systemcheck.json' || fail "the diag archive has no systemcheck.json"
if tar -xzOf "$WORK/agent/tmp/diag.tar.gz" | grep -q dev-token; then fail "the diag archive holds the token"; fi
echo "ok   relay-agent diag from the image: $(head -n 1 "$WORK/diag.txt")"

for n in agent ts-1 ts-2 dispatcher; do
  pid="$(cat "$WORK/$n.pid")"
  kill -TERM "$pid"
  status=0
  wait "$pid" || status=$?
  [ "$status" = 0 ] || { tail -n 5 "$WORK/$n.log"; fail "$n exited with status $status after SIGTERM"; }
done
echo "ok   SIGTERM: every process drained and exited 0"
kill -TERM "$UPSTREAM" 2>/dev/null || true
wait "$UPSTREAM" 2>/dev/null || true
echo "deploy/container/check.sh: all checks passed"
