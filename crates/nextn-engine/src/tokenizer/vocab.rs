//! Token attributes and the special-token conventions llama.cpp applies when it loads a vocabulary.
//!
//! GGUF stores a type per token; llama.cpp turns it into attribute bits and then, because converters
//! often mistype chat tokens, recognises end-of-turn / FIM tokens by their text: it forces them to
//! CONTROL and builds the end-of-generation set from them. Tokenization depends on the result (a
//! USER_DEFINED token is matched in text even without `parse_special`, a CONTROL one only with it).

/// llama.cpp's `llama_token_attr` bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct TokenAttr(u16);

impl TokenAttr {
    pub const UNDEFINED: TokenAttr = TokenAttr(0);
    pub const UNKNOWN: TokenAttr = TokenAttr(1 << 0);
    pub const UNUSED: TokenAttr = TokenAttr(1 << 1);
    pub const NORMAL: TokenAttr = TokenAttr(1 << 2);
    pub const CONTROL: TokenAttr = TokenAttr(1 << 3);
    pub const USER_DEFINED: TokenAttr = TokenAttr(1 << 4);
    pub const BYTE: TokenAttr = TokenAttr(1 << 5);

    pub fn from_gguf_type(token_type: i32) -> TokenAttr {
        match token_type {
            1 => TokenAttr::NORMAL,
            2 => TokenAttr::UNKNOWN,
            3 => TokenAttr::CONTROL,
            4 => TokenAttr::USER_DEFINED,
            5 => TokenAttr::UNUSED,
            6 => TokenAttr::BYTE,
            _ => TokenAttr::UNDEFINED,
        }
    }

    pub fn has(self, other: TokenAttr) -> bool {
        self.0 & other.0 != 0
    }

    pub fn with(self, other: TokenAttr) -> TokenAttr {
        TokenAttr(self.0 | other.0)
    }
}

const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];
const EOM_TEXTS: &[&str] = &["<|eom_id|>"];
const FIM_PRE_TEXTS: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
];
const FIM_SUF_TEXTS: &[&str] = &[
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
];
const FIM_MID_TEXTS: &[&str] = &[
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
];
const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP_TEXTS: &[&str] = &[
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
];
const FIM_SEP_TEXTS: &[&str] = &["<|file_sep|>"];

/// Token texts that end generation wherever they appear in a vocabulary.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// gpt-oss channel markers llama.cpp always renders as plain user-defined text.
const FORCED_USER_DEFINED_TEXTS: &[&str] =
    &["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"];

/// Special ids after llama.cpp's text-based detection.
#[derive(Debug, Clone, Default)]
pub(crate) struct DetectedSpecials {
    pub eot: Option<u32>,
    /// Sorted, deduplicated.
    pub eog: Vec<u32>,
}

/// Applies llama.cpp's load-time retyping to `attrs` and returns the end-of-turn and end-of-generation
/// ids. `eos` / `eot` are the ids the file declares.
pub(crate) fn detect_specials(
    tokens: &[String],
    attrs: &mut [TokenAttr],
    eos: Option<u32>,
    declared_eot: Option<u32>,
) -> DetectedSpecials {
    let find_first = |texts: &[&str]| -> Option<u32> {
        tokens
            .iter()
            .position(|t| texts.contains(&t.as_str()))
            .map(|i| i as u32)
    };
    let force_control = |id: Option<u32>, attrs: &mut [TokenAttr]| {
        if let Some(attr) = id.and_then(|id| attrs.get_mut(id as usize)) {
            *attr = attr.with(TokenAttr::CONTROL);
        }
    };

    // A role is only looked up by text when the file does not declare it, and only the token found
    // that way is retyped.
    let eot = match declared_eot {
        Some(id) => Some(id),
        None => {
            let found = find_first(EOT_TEXTS);
            force_control(found, attrs);
            found
        }
    };
    let eom = find_first(EOM_TEXTS);
    force_control(eom, attrs);
    for texts in [FIM_PRE_TEXTS, FIM_SUF_TEXTS, FIM_MID_TEXTS] {
        force_control(find_first(texts), attrs);
    }
    let fim_pad = find_first(FIM_PAD_TEXTS);
    let fim_rep = find_first(FIM_REP_TEXTS);
    let fim_sep = find_first(FIM_SEP_TEXTS);
    for id in [fim_pad, fim_rep, fim_sep] {
        force_control(id, attrs);
    }

    let mut eog: Vec<u32> = [fim_pad, fim_rep, fim_sep].into_iter().flatten().collect();
    for (id, text) in tokens.iter().enumerate() {
        if EOG_TEXTS.contains(&text.as_str()) {
            eog.push(id as u32);
            force_control(Some(id as u32), attrs);
        }
    }
    for (id, text) in tokens.iter().enumerate() {
        if FORCED_USER_DEFINED_TEXTS.contains(&text.as_str()) {
            attrs[id] = TokenAttr::USER_DEFINED;
        }
    }
    eog.extend([eos, eot, eom].into_iter().flatten());
    eog.sort_unstable();
    eog.dedup();

    let eog_id =
        |eog: &[u32], text: &str| eog.iter().copied().find(|&id| tokens[id as usize] == text);
    let has = |eog: &[u32], text: &str| eog_id(eog, text).is_some();
    // Harmony-style vocabularies end a message with <|end|> but only stop at <|return|> / <|call|>.
    if let Some(end) = eog_id(&eog, "<|end|>") {
        let call = has(&eog, "<|call|>") || has(&eog, "<|calls|>");
        if call && (has(&eog, "<|return|>") || has(&eog, "<|flush|>")) {
            eog.retain(|&id| id != end);
            attrs[end as usize] = TokenAttr::USER_DEFINED;
        }
    }
    // Vocabularies with <|tool_response> use </s> as ordinary text.
    if has(&eog, "<|tool_response>") {
        if let Some(s) = eog_id(&eog, "</s>") {
            eog.retain(|&id| id != s);
            attrs[s as usize] = TokenAttr::NORMAL;
        }
    }

    DetectedSpecials { eot, eog }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen_chat_tokens_become_control_and_end_generation() {
        let tokens: Vec<String> = [
            "a",
            "<|endoftext|>",
            "<|im_end|>",
            "<|fim_prefix|>",
            "<|fim_pad|>",
            "<|repo_name|>",
            "<|file_sep|>",
            "<think>",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let mut attrs = vec![
            TokenAttr::NORMAL,
            TokenAttr::CONTROL,
            TokenAttr::CONTROL,
            TokenAttr::USER_DEFINED,
            TokenAttr::USER_DEFINED,
            TokenAttr::USER_DEFINED,
            TokenAttr::USER_DEFINED,
            TokenAttr::USER_DEFINED,
        ];
        let found = detect_specials(&tokens, &mut attrs, Some(2), None);
        assert_eq!(found.eog, [1, 2, 4, 5, 6]);
        assert_eq!(found.eot, Some(1));
        for (id, attr) in attrs.iter().enumerate().take(7).skip(3) {
            assert!(attr.has(TokenAttr::CONTROL), "token {id}");
        }
        assert!(!attrs[7].has(TokenAttr::CONTROL));
    }
}
