//! The Kubernetes manifests (`deploy/kubernetes`), checked by the script operators and CI
//! run, `deploy/kubernetes/check.sh`: every base and overlay renders with kustomize, every
//! object validates strictly against the Kubernetes schemas (kubernetes-validate, pinned,
//! schemas bundled), and each workload's probes, scrape annotations, grace period (preStop
//! plus the drain its config allows), PodDisruptionBudget and ConfigMaps (no secret in
//! them) hold. The script installs its Python tools on first use (scripts/test does it up
//! front); a failure prints the object and the field.

use std::path::Path;
use std::process::Command;

#[test]
fn every_kustomization_renders_and_validates_against_the_kubernetes_schemas() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes/check.sh");
    let out = Command::new("bash")
        .arg(&script)
        .output()
        .expect("bash runs deploy/kubernetes/check.sh");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "check.sh failed:\n{text}");
    for dir in [
        "base/tunnel-server",
        "base/dispatcher",
        "base/agent",
        "overlays/tunnel-server",
        "overlays/dispatcher",
        "overlays/agent",
    ] {
        assert!(
            text.lines()
                .any(|l| l.starts_with(&format!("ok   {dir}: "))),
            "{dir} was not checked:\n{text}"
        );
    }
}
