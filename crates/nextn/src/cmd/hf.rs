//! `-hf REPO[:QUANT]` and `-hff FILE`: a model from the Hugging Face hub, as llama.cpp takes it.
//! Files go through the hub's standard local cache (`HF_HOME`, by default
//! `~/.cache/huggingface/hub`), so a model downloaded by llama.cpp or the `huggingface_hub`
//! Python package is found there and not fetched again. `HF_TOKEN` (or the token of
//! `huggingface-cli login`) authenticates, `HF_ENDPOINT` names another hub, and
//! `HF_HUB_OFFLINE=1` uses the cache alone (as does a hub that cannot be reached, for a repository
//! already in the cache). A split model comes with all of its shards.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use hf_hub::api::sync::ApiBuilder;
use hf_hub::{Cache, Repo};

/// The first (or only) file of the model that `spec` (`org/name[:QUANT]`) and `file` name,
/// fetched into the cache when it is not there yet.
pub fn resolve(spec: &str, file: Option<&str>) -> Result<PathBuf> {
    let (repo_id, quant) = match spec.split_once(':') {
        Some((r, q)) => (r, Some(q)),
        None => (spec, None),
    };
    if repo_id.split('/').filter(|p| !p.is_empty()).count() != 2 {
        bail!("-hf {spec}: expected a repository as ORG/NAME, optionally with :QUANT (e.g. unsloth/Qwen3.6-35B-A3B-GGUF:Q4_K_M)");
    }
    let wanted = choose(&repo_files(spec, repo_id)?, quant, file)
        .with_context(|| format!("-hf {spec}: choosing the GGUF file"))?;
    let mut paths = wanted
        .iter()
        .map(|f| fetch(spec, repo_id, f))
        .collect::<Result<Vec<_>>>()?;
    let first = paths.swap_remove(0);
    check_head(&first)?;
    Ok(first)
}

/// The projector (`mmproj`) file beside the `-hf` model, as llama.cpp finds it: the repository's
/// GGUF whose name has `mmproj`, F16 first, then BF16, then any; `None` when it has none.
pub fn resolve_mmproj(spec: &str) -> Result<Option<PathBuf>> {
    let repo_id = spec.split_once(':').map_or(spec, |(r, _)| r);
    let mut projectors: Vec<String> = repo_files(spec, repo_id)?
        .into_iter()
        .filter(|f| f.ends_with(".gguf") && f.to_ascii_lowercase().contains("mmproj"))
        .collect();
    projectors.sort_by_key(|f| {
        let l = f.to_ascii_lowercase();
        (
            !l.contains("f16") || l.contains("bf16"),
            !l.contains("bf16"),
            f.clone(),
        )
    });
    match projectors.first() {
        Some(f) => fetch(spec, repo_id, f).map(Some),
        None => Ok(None),
    }
}

fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE")
        .map(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"))
        .unwrap_or(false)
}

/// One file of the repository, from the cache or downloaded into it.
fn fetch(spec: &str, repo_id: &str, f: &str) -> Result<PathBuf> {
    let cache = Cache::from_env();
    let cached = cache.repo(Repo::model(repo_id.to_string()));
    Ok(match cached.get(f) {
        Some(p) => p,
        None if offline() => bail!(
            "-hf {spec}: HF_HUB_OFFLINE is set and {f} is not in the cache {}",
            cache.path().display()
        ),
        None => {
            eprintln!("downloading {repo_id}/{f} into {}", cache.path().display());
            api(&cache)?
                .model(repo_id.to_string())
                .get(f)
                .map_err(|e| anyhow::anyhow!("-hf {spec}: cannot download {f}: {e}"))?
        }
    })
}

/// The repository's files: from the hub, or with `HF_HUB_OFFLINE` (or when the hub cannot be
/// reached) from the cached snapshot.
fn repo_files(spec: &str, repo_id: &str) -> Result<Vec<String>> {
    let cache = Cache::from_env();
    let offline = offline();
    let files = if offline {
        cached_files(cache.path(), repo_id).with_context(|| {
            format!(
                "-hf {spec}: HF_HUB_OFFLINE is set and {repo_id} is not in the cache {}",
                cache.path().display()
            )
        })?
    } else {
        let api = api(&cache)?;
        match api.model(repo_id.to_string()).info() {
            Ok(info) => info.siblings.into_iter().map(|s| s.rfilename).collect(),
            // As llama.cpp does: a repository already in the cache is used from there when the
            // hub cannot be reached.
            Err(e) => match cached_files(cache.path(), repo_id) {
                Ok(files) => {
                    eprintln!(
                        "note: cannot list {repo_id} on the Hugging Face hub ({}): {e}; using its snapshot in the cache {}",
                        endpoint(),
                        cache.path().display()
                    );
                    files
                }
                Err(_) => bail!(
                    "-hf {spec}: cannot list {repo_id} on the Hugging Face hub ({}): {e} (set HF_TOKEN for a gated or private repository; with HF_HUB_OFFLINE=1 only the cache {} is used)",
                    endpoint(),
                    cache.path().display()
                ),
            },
        }
    };
    Ok(files)
}

/// `nextn verify`'s first question, before anything is served: is it a GGUF with an MTP head?
fn check_head(path: &Path) -> Result<()> {
    let f = nextn_gguf::GgufFile::open(path)
        .with_context(|| format!("the downloaded {} is not a usable GGUF", path.display()))?;
    let arch = f
        .get_str("general.architecture")?
        .unwrap_or_default()
        .to_string();
    let layers = f
        .get_u32(&format!("{arch}.nextn_predict_layers"))
        .ok()
        .flatten()
        .unwrap_or(0);
    if layers == 0 {
        eprintln!(
            "note: {} has no NextN (MTP) head: it runs without speculative decoding (`nextn verify` says more)",
            path.display()
        );
    }
    Ok(())
}

fn endpoint() -> String {
    std::env::var("HF_ENDPOINT").unwrap_or_else(|_| "https://huggingface.co".into())
}

fn api(cache: &Cache) -> Result<hf_hub::api::sync::Api> {
    let mut b = ApiBuilder::from_cache(cache.clone()).with_progress(true);
    if let Ok(e) = std::env::var("HF_ENDPOINT") {
        b = b.with_endpoint(e);
    }
    if let Ok(t) = std::env::var("HF_TOKEN") {
        b = b.with_token(Some(t));
    }
    b.build().context("cannot set up the Hugging Face client")
}

/// Files of the cached snapshot `refs/main` points at (the hub's cache layout).
fn cached_files(root: &Path, repo_id: &str) -> Result<Vec<String>> {
    let dir = root.join(format!("models--{}", repo_id.replace('/', "--")));
    let sha = std::fs::read_to_string(dir.join("refs").join("main"))
        .with_context(|| format!("{} has no refs/main", dir.display()))?;
    let snapshot = dir.join("snapshots").join(sha.trim());
    let mut out = Vec::new();
    let mut stack = vec![snapshot.clone()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).with_context(|| format!("cannot read {}", d.display()))? {
            let p = e?.path();
            if p.is_dir() {
                stack.push(p);
            } else if let Ok(rel) = p.strip_prefix(&snapshot) {
                out.push(rel.to_string_lossy().into_owned());
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Which files to fetch: `file` when given; else the GGUF whose name carries `quant` (llama.cpp's
/// default Q4_K_M when none is given, else the first GGUF), with every shard of a split model.
/// Projector files (`mmproj`) are never the model.
fn choose(files: &[String], quant: Option<&str>, file: Option<&str>) -> Result<Vec<String>> {
    let ggufs: Vec<&String> = files
        .iter()
        .filter(|f| f.ends_with(".gguf") && !f.to_ascii_lowercase().contains("mmproj"))
        .collect();
    let first = match file {
        Some(f) => {
            if !files.iter().any(|x| x == f) {
                bail!(
                    "the repository has no file {f} (GGUF files: {})",
                    list(&ggufs)
                );
            }
            f.to_string()
        }
        None => {
            let q = quant.unwrap_or("Q4_K_M").to_ascii_lowercase();
            let matching: Vec<&&String> = ggufs
                .iter()
                .filter(|f| f.to_ascii_lowercase().contains(&q))
                .collect();
            match (matching.first(), quant) {
                (Some(f), _) => f.to_string(),
                (None, None) if !ggufs.is_empty() => ggufs[0].to_string(),
                (None, Some(q)) => bail!("no GGUF file for {q} (GGUF files: {})", list(&ggufs)),
                (None, None) => bail!("the repository has no GGUF file"),
            }
        }
    };
    // `name-00001-of-00003.gguf`: every shard, in order.
    if let Some(stem) = first.strip_suffix(".gguf") {
        if let Some(pos) = stem.rfind("-of-") {
            let (head, count) = (&stem[..pos], &stem[pos + 4..]);
            if let (Some(dash), Ok(n)) = (head.rfind('-'), count.parse::<usize>()) {
                let base = &head[..dash];
                let width = count.len();
                return Ok((1..=n)
                    .map(|i| format!("{base}-{i:0width$}-of-{count}.gguf"))
                    .collect());
            }
        }
    }
    Ok(vec![first])
}

fn list(files: &[&String]) -> String {
    if files.is_empty() {
        "none".into()
    } else {
        files
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn quant_and_shards_are_chosen_as_llama_cpp_does() {
        let files = names(&[
            "README.md",
            "mmproj-F16.gguf",
            "Qwen3.6-27B-Q4_K_M.gguf",
            "Qwen3.6-27B-Q8_0.gguf",
            "Q6_K/Qwen3.6-27B-Q6_K-00001-of-00002.gguf",
            "Q6_K/Qwen3.6-27B-Q6_K-00002-of-00002.gguf",
        ]);
        assert_eq!(
            choose(&files, None, None).unwrap(),
            ["Qwen3.6-27B-Q4_K_M.gguf"]
        );
        assert_eq!(
            choose(&files, Some("q8_0"), None).unwrap(),
            ["Qwen3.6-27B-Q8_0.gguf"]
        );
        assert_eq!(
            choose(&files, Some("Q6_K"), None).unwrap(),
            [
                "Q6_K/Qwen3.6-27B-Q6_K-00001-of-00002.gguf",
                "Q6_K/Qwen3.6-27B-Q6_K-00002-of-00002.gguf"
            ]
        );
        assert!(choose(&files, Some("IQ2_XXS"), None).is_err());
        assert_eq!(
            choose(&files, None, Some("Qwen3.6-27B-Q8_0.gguf")).unwrap(),
            ["Qwen3.6-27B-Q8_0.gguf"]
        );
        assert!(choose(&files, None, Some("other.gguf")).is_err());
        assert!(choose(&names(&["README.md"]), None, None).is_err());
    }
}
