//! Models split over several files the way `llama-gguf-split` and gguf-py write them:
//! `<name>-00001-of-0000N.gguf` ... `<name>-0000N-of-0000N.gguf`, each carrying `split.no`
//! (0-based, u16), `split.count` (u16) and `split.tensors.count` (i32, total over all shards).
//! Only the first shard carries the model's other metadata.

use std::path::{Path, PathBuf};

use crate::reader::ShardHeader;
use crate::{GgufError, MetadataValue, Shard};

pub const SPLIT_NO_KEY: &str = "split.no";
pub const SPLIT_COUNT_KEY: &str = "split.count";
pub const SPLIT_TENSORS_COUNT_KEY: &str = "split.tensors.count";

/// `<stem>-<no>-of-<count>.gguf` with 1-based `no`, five digits as llama.cpp formats them.
pub fn split_shard_path(stem: &Path, no: u64, count: u64) -> PathBuf {
    let mut name = stem.as_os_str().to_owned();
    name.push(format!("-{no:05}-of-{count:05}.gguf"));
    PathBuf::from(name)
}

/// Splits `<prefix>-NNNNN-of-MMMMM.gguf` into (prefix, 1-based number, count).
pub(crate) fn parse_shard_name(file_name: &str) -> Option<(&str, u64, u64)> {
    let body = file_name.strip_suffix(".gguf")?;
    let (rest, count) = body.rsplit_once("-of-")?;
    let (prefix, no) = rest.rsplit_once('-')?;
    let digits = |s: &str| -> Option<u64> {
        if s.len() < 5 || !s.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        s.parse().ok()
    };
    let (no, count) = (digits(no)?, digits(count)?);
    if prefix.is_empty() || no == 0 || no > count {
        return None;
    }
    Some((prefix, no, count))
}

fn split_value(h: &ShardHeader, key: &str) -> Result<Option<u64>, GgufError> {
    let Some(&i) = h.kv_index.get(key) else {
        return Ok(None);
    };
    let v: &MetadataValue = &h.kvs[i].1;
    match v.as_u64() {
        Some(x) => Ok(Some(x)),
        None => Err(GgufError::MetadataType {
            key: key.to_owned(),
            expected: "a non-negative integer",
            found: v.describe(),
        }),
    }
}

fn in_file(path: &Path, e: GgufError) -> GgufError {
    GgufError::InFile {
        path: path.to_owned(),
        source: Box::new(e),
    }
}

/// Given the parsed shard at `path`, finds, opens and cross-checks every shard of its model.
pub(crate) fn open_all_shards(
    path: &Path,
    first: Shard,
) -> Result<(Vec<Shard>, Vec<PathBuf>), GgufError> {
    let h = first.header();
    let meta_count = split_value(h, SPLIT_COUNT_KEY).map_err(|e| in_file(path, e))?;
    let meta_no = split_value(h, SPLIT_NO_KEY).map_err(|e| in_file(path, e))?;
    let meta_tensors = split_value(h, SPLIT_TENSORS_COUNT_KEY).map_err(|e| in_file(path, e))?;
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(parse_shard_name);

    let count = match (meta_count, name) {
        (Some(m), Some((_, _, n))) if m != n => {
            return Err(GgufError::SplitNameMismatch {
                path: path.to_owned(),
                from_name: n,
                from_metadata: m,
            })
        }
        (Some(m), _) => m,
        (None, Some((_, _, n))) => n,
        (None, None) => 1,
    };
    if count == 0 {
        return Err(in_file(
            path,
            GgufError::MetadataType {
                key: SPLIT_COUNT_KEY.to_owned(),
                expected: "a shard count of at least 1",
                found: "0".to_owned(),
            },
        ));
    }
    let shard_no = meta_no.or(name.map(|(_, no, _)| no - 1)).unwrap_or(0);
    if shard_no != 0 {
        return Err(GgufError::NotFirstShard {
            path: path.to_owned(),
            shard_no,
            count,
        });
    }

    let mut shards = vec![first];
    let mut paths = vec![path.to_owned()];
    if count > 1 {
        let Some((prefix, _, _)) = name else {
            return Err(GgufError::UnnamedSplit {
                path: path.to_owned(),
                count,
            });
        };
        let stem = path.with_file_name(prefix);
        for k in 1..count {
            let shard_path = split_shard_path(&stem, k + 1, count);
            if !shard_path.is_file() {
                return Err(GgufError::MissingShard {
                    path: shard_path,
                    index: k + 1,
                    count,
                });
            }
            // `k < count <= u16::MAX` in practice; usize is at least 32 bits on our targets.
            let shard = Shard::open(&shard_path, k as usize)?;
            let sh = shard.header();
            let in_this = |e| in_file(&shard_path, e);
            if let Some(c) = split_value(sh, SPLIT_COUNT_KEY).map_err(in_this)? {
                if c != count {
                    return Err(GgufError::SplitCountMismatch {
                        path: shard_path,
                        expected: count,
                        found: c,
                    });
                }
            }
            if let Some(no) = split_value(sh, SPLIT_NO_KEY).map_err(in_this)? {
                if no != k {
                    return Err(GgufError::SplitNoMismatch {
                        path: shard_path,
                        expected: k,
                        found: no,
                    });
                }
            }
            shards.push(shard);
            paths.push(shard_path);
        }
    }

    let found: u64 = shards.iter().map(|s| s.header().tensors.len() as u64).sum();
    if let Some(expected) = meta_tensors {
        if expected != found {
            return Err(GgufError::SplitTensorCount {
                expected,
                found,
                shards: shards.len(),
            });
        }
    }
    // Duplicate names across shards are refused when the directory is assembled.
    Ok((shards, paths))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_names() {
        assert_eq!(
            parse_shard_name("model-00001-of-00003.gguf"),
            Some(("model", 1, 3))
        );
        assert_eq!(
            parse_shard_name("a-b-00002-of-00002.gguf"),
            Some(("a-b", 2, 2))
        );
        assert_eq!(parse_shard_name("model-00004-of-00003.gguf"), None);
        assert_eq!(parse_shard_name("model-1-of-3.gguf"), None);
        assert_eq!(parse_shard_name("model.gguf"), None);
        assert_eq!(
            split_shard_path(Path::new("/x/m"), 2, 10),
            PathBuf::from("/x/m-00002-of-00010.gguf")
        );
    }
}
