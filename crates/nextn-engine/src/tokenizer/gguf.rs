//! Reading a [`TokenizerSpec`] from GGUF metadata.

use nextn_gguf::{GgufFile, MetadataArray};

use super::{pre_tokenizer, TokenizerError, TokenizerSpec};

const KEY_MODEL: &str = "tokenizer.ggml.model";
const KEY_PRE: &str = "tokenizer.ggml.pre";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
const KEY_MERGES: &str = "tokenizer.ggml.merges";
const KEY_BOS: &str = "tokenizer.ggml.bos_token_id";
const KEY_EOS: &str = "tokenizer.ggml.eos_token_id";
const KEY_EOT: &str = "tokenizer.ggml.eot_token_id";
const KEY_PAD: &str = "tokenizer.ggml.padding_token_id";
const KEY_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";

fn required<T>(value: Option<T>, key: &'static str) -> Result<T, TokenizerError> {
    value.ok_or(TokenizerError::MissingKey { key })
}

fn string_array<'f>(
    f: &'f GgufFile,
    key: &'static str,
) -> Result<Option<&'f [String]>, TokenizerError> {
    let Some(array) = f.get_array(key)? else {
        return Ok(None);
    };
    array
        .as_strings()
        .map(Some)
        .ok_or_else(|| type_error(key, "an array of strings", array))
}

fn type_error(key: &'static str, expected: &'static str, array: &MetadataArray) -> TokenizerError {
    TokenizerError::KeyType {
        key,
        expected,
        found: format!("an array of {} {}", array.len(), array.element_type_name()),
    }
}

impl TokenizerSpec {
    pub fn from_gguf(f: &GgufFile) -> Result<Self, TokenizerError> {
        let (mut spec, merges) = TokenizerSpec::from_gguf_without_merges(f)?;
        spec.merges = merges.to_vec();
        Ok(spec)
    }

    /// The spec with empty `merges`, plus the merge lines borrowed from the file (copying 250k
    /// strings only to drop them after building is a measurable part of loading).
    pub(crate) fn from_gguf_without_merges(
        f: &GgufFile,
    ) -> Result<(Self, &[String]), TokenizerError> {
        let model = required(f.get_str(KEY_MODEL)?, KEY_MODEL)?.to_owned();
        if model != "gpt2" {
            return Err(TokenizerError::UnsupportedModel(model));
        }
        let pre = f.get_str(KEY_PRE)?.map(str::to_owned);
        let tokens = required(string_array(f, KEY_TOKENS)?, KEY_TOKENS)?.to_vec();
        let merges = required(string_array(f, KEY_MERGES)?, KEY_MERGES)?;
        let token_types = match f.get_array(KEY_TOKEN_TYPE)? {
            None => None,
            Some(array) => Some(
                array
                    .as_i32_vec()
                    .ok_or_else(|| type_error(KEY_TOKEN_TYPE, "an array of i32", array))?,
            ),
        };
        // The llama3 family prepends BOS unless the file says otherwise; everything else does not.
        let add_bos_default = pre
            .as_deref()
            .and_then(pre_tokenizer)
            .is_some_and(|p| p.ignore_merges);
        let spec = TokenizerSpec {
            model,
            pre,
            tokens,
            token_types,
            merges: Vec::new(),
            bos: f.get_u32(KEY_BOS)?,
            eos: f.get_u32(KEY_EOS)?,
            eot: f.get_u32(KEY_EOT)?,
            pad: f.get_u32(KEY_PAD)?,
            add_bos: f.get_bool(KEY_ADD_BOS)?.unwrap_or(add_bos_default),
        };
        Ok((spec, merges))
    }
}
