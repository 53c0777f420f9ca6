//! One fully qualified image name everywhere (issue 37): the manifests' containers, the
//! kustomize `images:` entries, `scripts/image.sh`, the Containerfile's build lines, the pod test
//! and the build and load commands of containers/README.md all say `localhost/tunnelgate:latest`
//! (a short `tunnelgate:latest` is `docker.io/library/tunnelgate:latest` to containerd, which
//! would go to Docker Hub for it). Pointing every container at a registry is one edit of a
//! kustomization's `newName`.

use super::*;

/// The image's repository (without the tag), as the kustomizations' `images:` entries name it.
pub(crate) const IMAGE_NAME: &str = "localhost/tunnelgate";
const IMAGE: &str = "localhost/tunnelgate:latest";

fn repo_file(path: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(path))
        .unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Every token that names a tunnelgate image (`[REGISTRY/PATH/]tunnelgate:TAG`) in `text`.
fn image_refs(text: &str) -> BTreeSet<String> {
    // `${VAR:-default}` in shell: the default is a word of its own.
    text.replace(":-", " ")
        .split(|c: char| c.is_whitespace() || "\"'`(),=;{}$".contains(c))
        .filter(|w| {
            // REGISTRY[:PORT]/PATH/tunnelgate:TAG, not a file path such as /etc/tunnelgate:ro.
            let parts: Vec<&str> = w.split('/').collect();
            let (name, path) = parts.split_last().expect("split yields one part");
            name.starts_with("tunnelgate:")
                && name.len() > "tunnelgate:".len()
                && path.iter().all(|p| !p.is_empty() && !p.starts_with(':'))
        })
        .map(str::to_string)
        .collect()
}

/// The `sh` code blocks of a Markdown file.
fn sh_blocks(markdown: &str) -> String {
    let mut out = String::new();
    let mut inside = false;
    for line in markdown.lines() {
        let fence = line.trim_start();
        if fence.starts_with("```") {
            inside = !inside && fence == "```sh";
            continue;
        }
        if inside {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// The tunnelgate images of every container of every manifest in `dir`.
fn container_images(dir: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (file, doc) in documents_in(dir) {
        let spec = &doc["spec"]["template"]["spec"];
        for c in ["initContainers", "containers"]
            .iter()
            .filter_map(|k| spec[*k].as_array())
            .flatten()
        {
            let image = c["image"].as_str().unwrap_or_default().to_string();
            if !image.contains("nginx") {
                out.push((format!("{file}: {}", c["name"]), image));
            }
        }
    }
    out
}

#[test]
fn one_fully_qualified_image_name_everywhere() {
    for d in [dir(), group_dir()] {
        let images = container_images(&d);
        assert!(images.len() >= 3, "proxy, sidecar and init: {images:?}");
        for (container, image) in &images {
            assert_eq!(image, IMAGE, "{container}");
        }
        let kustomization = documents_in(&d)
            .into_iter()
            .find(|(f, _)| f == "kustomization.yaml")
            .expect("kustomization.yaml")
            .1;
        let entries = kustomization["images"].as_array().expect("images:");
        assert_eq!(entries.len(), 1, "{entries:?}");
        assert_eq!(entries[0]["name"], IMAGE_NAME);
        assert_eq!(
            format!(
                "{}:{}",
                entries[0]["newName"].as_str().unwrap_or_default(),
                entries[0]["newTag"].as_str().unwrap_or_default()
            ),
            IMAGE,
            "the entry leaves the name as it is until a registry is set"
        );
    }
    let want = BTreeSet::from([IMAGE.to_string()]);
    for (what, text) in [
        ("scripts/image.sh", repo_file("scripts/image.sh")),
        (
            "containers/Containerfile",
            repo_file("containers/Containerfile"),
        ),
        (
            "tests/sidecar_fake_api/pod_image.rs",
            repo_file("tests/sidecar_fake_api/pod_image.rs"),
        ),
        (
            "containers/README.md (commands)",
            sh_blocks(&repo_file("containers/README.md")),
        ),
        ("README.md (commands)", sh_blocks(&repo_file("README.md"))),
    ] {
        let refs = image_refs(&text);
        assert!(
            refs.is_empty() || refs == want,
            "{what} names {refs:?}, not only {IMAGE}"
        );
    }
    assert_eq!(image_refs(&repo_file("scripts/image.sh")), want);
    let readme = sh_blocks(&repo_file("containers/README.md"));
    for command in [
        format!("podman build -f containers/Containerfile -t {IMAGE} ."),
        format!("podman save -o tunnelgate.tar {IMAGE}"),
        "kind load image-archive tunnelgate.tar".to_string(),
    ] {
        assert!(readme.contains(&command), "containers/README.md: {command}");
    }
    assert!(
        !readme.contains("kind load docker-image"),
        "kind load docker-image reads from Docker, not podman"
    );
}

#[test]
fn the_image_reference_reader_finds_names() {
    assert_eq!(
        image_refs("podman build -t localhost/tunnelgate:latest . # \"tunnelgate:x\" tunnelgate-base:bookworm tunnelgate: tunnelgate ${T:-a/tunnelgate:y} {}:/etc/tunnelgate:ro"),
        BTreeSet::from([
            "a/tunnelgate:y".to_string(),
            "localhost/tunnelgate:latest".to_string(),
            "tunnelgate:x".to_string()
        ])
    );
    assert_eq!(sh_blocks("a\n```sh\nx\n```\n```ini\ny\n```\n"), "x\n");
}

/// A registry is one edit: `newName`/`newTag` of the kustomization's `images:` entry moves every
/// container of the deployment (proxy, sidecar, init), and nothing else, in what `kubectl apply
/// -k` sends. Skipped without kubectl ([`common::skip`]: a failure under `CI=true`).
#[test]
fn a_registry_is_one_edit_of_the_kustomization() {
    if !kubectl_or_skip() {
        return;
    }
    const PUSHED: &str = "registry.example.com/team/tunnelgate";
    for d in [dir(), group_dir()] {
        let tmp = std::env::temp_dir().join(format!(
            "tg-kustomize-{}-{}",
            std::process::id(),
            d.file_name().and_then(|n| n.to_str()).unwrap_or("k8s")
        ));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).expect("temp dir");
        for entry in std::fs::read_dir(&d).expect("read_dir").flatten() {
            if entry.path().is_file() {
                std::fs::copy(entry.path(), tmp.join(entry.file_name())).expect("copy");
            }
        }
        let kustomization = tmp.join("kustomization.yaml");
        let text = std::fs::read_to_string(&kustomization).expect("kustomization");
        let edited = text
            .replace(
                &format!("newName: {IMAGE_NAME}"),
                &format!("newName: {PUSHED}"),
            )
            .replace("newTag: latest", "newTag: v1");
        assert_ne!(edited, text, "newName and newTag are there to edit");
        std::fs::write(&kustomization, edited).expect("edit");
        let out = Command::new("kubectl")
            .args(["kustomize"])
            .arg(&tmp)
            .env("KUBECONFIG", "/dev/null")
            .output()
            .expect("kubectl kustomize");
        let _ = std::fs::remove_dir_all(&tmp);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let built: Vec<Value> =
            serde_saphyr::from_multiple(&String::from_utf8(out.stdout).expect("utf-8"))
                .expect("kustomize output parses");
        let mut moved = 0;
        for o in &built {
            let spec = &o["spec"]["template"]["spec"];
            for c in ["initContainers", "containers"]
                .iter()
                .filter_map(|k| spec[*k].as_array())
                .flatten()
            {
                let image = c["image"].as_str().unwrap_or_default();
                if image.contains("nginx") {
                    assert!(image.starts_with("nginx:"), "{image}: not ours, not moved");
                } else {
                    assert_eq!(image, format!("{PUSHED}:v1"), "{}", c["name"]);
                    moved += 1;
                }
            }
        }
        assert!(moved >= 3, "{}: {moved} containers moved", d.display());
    }
}
