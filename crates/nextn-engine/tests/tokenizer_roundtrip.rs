//! Encoding then decoding any text gives the text back on the real Qwen vocabulary (every byte has
//! a token and no normalisation is applied), with or without special-token parsing.

use nextn_engine::tokenizer::Tokenizer;
use nextn_gguf::GgufFile;

fn qwen_tokenizer() -> Option<Tokenizer> {
    let dir = nextn_testdata::shared("golden/q35-dense-qwenvocab")?;
    let path = dir.join("q35-dense-qwenvocab-F32-embQ8_0.gguf");
    let file = GgufFile::open(&path).expect("open");
    Some(Tokenizer::from_gguf(&file).expect("tokenizer"))
}

const POOL: &[&str] = &[
    "a",
    "Z",
    "é",
    "中",
    "文",
    "ñ",
    "'",
    "s",
    "T",
    "re",
    " ",
    "  ",
    "1",
    "٣",
    "\t",
    "\n",
    "\r\n",
    ".",
    "...",
    "<",
    ">",
    "|",
    "\u{301}",
    "\u{a0}",
    "\u{3000}",
    "\u{200b}",
    "😀",
    "👍🏽",
    "\u{200d}",
    "ก",
    "ि",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<|fim_prefix|>",
    "<|endoftext",
    "|>",
    "Hello",
    " world",
    "\u{0}",
    "\u{7f}",
];

#[test]
fn random_texts_round_trip() {
    let Some(tokenizer) = qwen_tokenizer() else {
        return;
    };
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for _ in 0..2000 {
        let len = (next() % 20) as usize;
        let text: String = (0..len)
            .map(|_| POOL[(next() % POOL.len() as u64) as usize])
            .collect();
        for parse_special in [true, false] {
            let ids = tokenizer.encode(&text, parse_special);
            assert!(ids.iter().all(|&id| (id as usize) < tokenizer.vocab_size()));
            assert_eq!(
                tokenizer.decode(&ids),
                text,
                "parse_special {parse_special}: {ids:?}"
            );
        }
        // Control tokens are only produced when parsing specials.
        let plain = tokenizer.encode(&text, false);
        for control in ["<|im_start|>", "<|im_end|>", "<|fim_prefix|>"] {
            let id = tokenizer.token_id(control).expect(control);
            assert!(!plain.contains(&id), "{text:?}");
        }
    }
}

#[test]
fn large_input_encodes_quickly_enough() {
    let Some(tokenizer) = qwen_tokenizer() else {
        return;
    };
    let paragraph = "The quick brown fox jumps over the lazy dog. 人力资源和社会保障部 \
                     fn main() { println!(\"{}\", 42); }\n\tnaïve café — “quotes” 😀\n";
    let text = paragraph.repeat(4000); // ~0.5 MB
    let ids = tokenizer.encode(&text, true);
    assert_eq!(tokenizer.decode(&ids), text);
    // A repeated paragraph tokenizes to repeated ids except at the seams.
    let one = tokenizer.encode(paragraph, true);
    assert!(ids.len() <= one.len() * 4000 && ids.len() + 4000 >= one.len() * 4000);
}
