//! Every manifest is valid against the Kubernetes schemas (kubernetes-validate, set up by
//! scripts/kubernetes-validate.sh), and images are not pulled when present.

use super::*;

/// Where `scripts/kubernetes-validate.sh` (run by scripts/test.sh) puts its virtual
/// environment, unless `TUNNELGATE_VALIDATE_VENV` moves it: Debian 12's pip refuses to install
/// into the system's Python (PEP 668), so the validator has an environment of its own.
const VENV: &str = "/var/tmp/tunnelgate-kubernetes-validate";
/// The schemas' Kubernetes version.
const KUBERNETES: &str = "1.33.0";

/// `kubernetes-validate`: the virtual environment's, else one on PATH; `None` when neither runs
/// (the test skips: a failure under `CI=true`).
pub(crate) fn validator_or_skip() -> Option<PathBuf> {
    let venv = std::env::var_os("TUNNELGATE_VALIDATE_VENV")
        .map_or_else(|| PathBuf::from(VENV), PathBuf::from);
    let runs = |p: &Path| {
        Command::new(p)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let found = [
        venv.join("bin/kubernetes-validate"),
        PathBuf::from("kubernetes-validate"),
    ]
    .into_iter()
    .find(|p| runs(p));
    if found.is_none() {
        common::skip(format!(
            "kubernetes-validate is neither in {} nor on PATH: scripts/kubernetes-validate.sh \
             installs it there",
            venv.display()
        ));
    }
    found
}

/// `kubernetes-validate --strict` of one file against the Kubernetes schemas: its report when
/// an object is not valid.
pub(crate) fn validate(validator: &Path, file: &Path) -> Result<(), String> {
    let out = Command::new(validator)
        .args(["--strict", "-k", KUBERNETES])
        .arg(file)
        .output()
        .map_err(|e| format!("run {}: {e}", validator.display()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{} is not valid:\n{}{}",
            file.display(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// `kubernetes-validate --strict -k 1.33.0` on every manifest (but the kustomizations): each
/// object is valid against the real OpenAPI schemas.
#[test]
fn every_manifest_is_valid_against_the_kubernetes_schemas() {
    let Some(validator) = validator_or_skip() else {
        return;
    };
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
            if let Err(report) = validate(&validator, &f) {
                panic!("{report}");
            }
            checked += 1;
        }
    }
    assert!(checked >= 11, "{checked} files");
}

/// The validator refuses what the schemas refuse: a field the API does not have (`--strict`)
/// and a value of the wrong type, each in a copy of a real manifest. Without this, a validator
/// that accepts everything (a wrong version, a broken install) would pass the test above.
#[test]
fn the_validator_refuses_an_invalid_manifest() {
    let Some(validator) = validator_or_skip() else {
        return;
    };
    let good = std::fs::read_to_string(dir().join("statefulset.yaml")).expect("statefulset.yaml");
    let tmp = common::TempDir::new("tg-schema");
    let file = tmp.path().join("statefulset.yaml");
    std::fs::write(&file, &good).expect("write");
    assert_eq!(validate(&validator, &file), Ok(()), "the copy as it is");
    for (what, from, to) in [
        ("an unknown field", "  serviceName:", "  serviceNameTypo:"),
        (
            "a string for an integer",
            "  replicas: 1",
            "  replicas: one",
        ),
    ] {
        assert!(good.contains(from), "statefulset.yaml has {from:?}");
        std::fs::write(&file, good.replacen(from, to, 1)).expect("write");
        assert!(validate(&validator, &file).is_err(), "{what} passed");
    }
}

/// The test and the script agree on where the virtual environment is.
#[test]
fn the_setup_script_makes_the_environment_the_test_uses() {
    let script = std::fs::read_to_string(dir().join("../../scripts/kubernetes-validate.sh"))
        .expect("scripts/kubernetes-validate.sh");
    assert!(
        script.contains(&format!("TUNNELGATE_VALIDATE_VENV:-{VENV}")),
        "the script's default is {VENV}"
    );
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
