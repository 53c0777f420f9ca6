//! Every manifest is valid against the Kubernetes schemas, and images are not pulled when present.

use super::*;

/// `kubernetes-validate --strict -k 1.33.0` on every manifest (but the kustomizations): each
/// object is valid against the real OpenAPI schemas. Without the tool (`pip install
/// kubernetes-validate`) the test is skipped with a note, except in CI, where it fails.
#[test]
fn every_manifest_is_valid_against_the_kubernetes_schemas() {
    if Command::new("kubernetes-validate")
        .arg("--version")
        .output()
        .is_err()
    {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "kubernetes-validate is not installed: pip install kubernetes-validate"
        );
        eprintln!(
            "SKIPPED: kubernetes-validate is not installed (pip install kubernetes-validate)"
        );
        return;
    }
    let mut checked = 0;
    for d in [dir(), group_dir()] {
        let mut files: Vec<PathBuf> = std::fs::read_dir(&d)
            .expect("manifest dir")
            .map(|e| e.expect("entry").path())
            .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
            .filter(|p| !p.ends_with("kustomization.yaml"))
            .collect();
        files.sort();
        for f in files {
            let out = Command::new("kubernetes-validate")
                .args(["--strict", "-k", "1.33.0"])
                .arg(&f)
                .output()
                .expect("run kubernetes-validate");
            assert!(
                out.status.success(),
                "{} is not valid:\n{}{}",
                f.display(),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            checked += 1;
        }
    }
    assert!(checked >= 11, "{checked} files");
}

#[test]
fn images_are_not_pulled_when_present() {
    for docs in [documents(), documents_in(&group_dir())] {
        for (file, doc) in docs {
            let spec = &doc["spec"]["template"]["spec"];
            for c in ["initContainers", "containers"]
                .iter()
                .filter_map(|k| spec[*k].as_array())
                .flatten()
                // The locally built (loaded) image; public ones may be pulled.
                .filter(|c| {
                    c["image"]
                        .as_str()
                        .is_some_and(|i| i.starts_with(&format!("{IMAGE_NAME}:")))
                })
            {
                assert_eq!(
                    c["imagePullPolicy"], "IfNotPresent",
                    "{file}: container {}",
                    c["name"]
                );
            }
        }
    }
}
