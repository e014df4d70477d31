"""Checks rendered relay manifests (one multi-document YAML file per run) for what the
Kubernetes schemas cannot see: each workload's probes reach /readyz and /healthz on the
port its config's admin_listen names, Prometheus scrapes that port, the pod's
terminationGracePeriodSeconds covers its preStop sleep plus the drain its config allows
(shutdown_grace) with room to spare, a PodDisruptionBudget covers it, and no config held
in a ConfigMap carries a secret. Prints one line per problem; exit 1 when there is one.

Usage: python3 check_rendered.py RENDERED.yaml
"""

import re
import sys
import tomllib

import yaml

# Each binary's drain when its config does not set shutdown_grace (docs/configuration.md);
# the agent's drain grace is fixed.
DEFAULT_DRAIN = {"relay-tunnel-server": 30, "relay-dispatcher": 10}
AGENT_DRAIN = 10
# Spare seconds between the end of the drain and SIGKILL.
SPARE = 5
SECRET_KEYS = {"token", "dispatcher_key", "server_key", "record_key", "password"}


def seconds(text):
    """A duration as the relay writes them ("30s", "1m30s", "250ms") in seconds."""
    total = 0.0
    for num, unit in re.findall(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h)", text):
        total += float(num) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
    if not re.fullmatch(r"(\s*\d+(\.\d+)?\s*(ms|s|m|h))+\s*", text):
        raise ValueError(f"not a duration: {text!r}")
    return total


def secrets_in(table, path=""):
    """Keys of a parsed config that hold a secret in clear."""
    found = []
    for key, value in table.items():
        where = f"{path}{key}"
        if isinstance(value, dict):
            found += secrets_in(value, where + ".")
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, dict):
                    found += secrets_in(item, where + "[].")
        elif key in SECRET_KEYS or (key == "key" and not path.rstrip(".").endswith("tls")):
            found.append(where)
        elif isinstance(value, str) and re.match(r"^\w+://[^/@]*:[^/@]+@", value):
            found.append(where + " (a URL with a password)")
    return found


def main(path):
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    problems = []
    configmaps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    if not workloads:
        problems.append("no Deployment or StatefulSet rendered")
    for w in workloads:
        name = f'{w["kind"]}/{w["metadata"]["name"]}'
        pod = w["spec"]["template"]
        spec = pod["spec"]
        c = spec["containers"][0]
        binary = c["image"].rsplit("/", 1)[-1].split(":")[0]
        args = c.get("args", [])
        if "--config" not in args:
            problems.append(f"{name}: no --config argument")
            continue
        config_path = args[args.index("--config") + 1]
        mount = next(
            (m for m in c.get("volumeMounts", []) if config_path.startswith(m["mountPath"] + "/")),
            None,
        )
        volume = mount and next((v for v in spec["volumes"] if v["name"] == mount["name"]), None)
        cm = volume and volume.get("configMap") and configmaps.get(volume["configMap"]["name"])
        if not cm:
            problems.append(f"{name}: {config_path} is not a file of a rendered ConfigMap")
            continue
        config = tomllib.loads(cm["data"][config_path.rsplit("/", 1)[-1]])
        for s in secrets_in(config):
            problems.append(f'{name}: ConfigMap {cm["metadata"]["name"]} holds a secret: {s}')

        # Probes and scraping on the admin listener the config names.
        admin = config.get("admin_listen", "")
        admin_port = int(admin.rsplit(":", 1)[-1]) if admin else None
        if admin_port is None or not admin.startswith(("0.0.0.0:", "[::]:")):
            problems.append(f"{name}: admin_listen {admin!r} is not reachable from the kubelet")
        ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
        for probe, want in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
            get = c.get(probe, {}).get("httpGet", {})
            port = ports.get(get.get("port"), get.get("port"))
            if get.get("path") != want or port != admin_port:
                problems.append(
                    f"{name}: {probe} is GET {get.get('path')} on port {port}, "
                    f"not {want} on the admin port {admin_port}"
                )
        ann = pod["metadata"].get("annotations", {})
        if ann.get("prometheus.io/scrape") != "true" or ann.get("prometheus.io/port") != str(admin_port):
            problems.append(f"{name}: Prometheus annotations do not scrape the admin port {admin_port}")

        # Drain: preStop + the config's drain + spare within the grace period.
        grace = spec.get("terminationGracePeriodSeconds", 30)
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        if binary == "relay-agent":
            drain = AGENT_DRAIN
        else:
            drain = seconds(config.get("shutdown_grace", f"{DEFAULT_DRAIN.get(binary, 30)}s"))
            if pre_stop <= 0:
                problems.append(f"{name}: no preStop sleep before SIGTERM")
        if grace < pre_stop + drain + SPARE:
            problems.append(
                f"{name}: terminationGracePeriodSeconds {grace} < preStop {pre_stop} + "
                f"drain {drain:g} + {SPARE} spare: pods would be killed mid-drain"
            )

        labels = pod["metadata"].get("labels", {})
        if not any(
            p["spec"]["selector"].get("matchLabels", {}).items() <= labels.items() for p in pdbs
        ):
            problems.append(f"{name}: no PodDisruptionBudget selects its pods")
    for p in problems:
        print(f"{path}: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
