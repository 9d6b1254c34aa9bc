//! Tokenizer vs llama.cpp (commit 34af94cd): every probe string of every golden fixture must give
//! exactly llama.cpp's ids (with and without special parsing), pieces and detokenization.

use std::path::PathBuf;
use std::time::Instant;

use nextn_engine::tokenizer::Tokenizer;
use nextn_gguf::GgufFile;
use serde_json::Value;

fn hex_decode(hex: &str) -> Vec<u8> {
    assert!(hex.len().is_multiple_of(2), "odd hex length");
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex digit"))
        .collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn load_json(path: &PathBuf) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn load_tokenizer(gguf: &PathBuf) -> Tokenizer {
    let file = GgufFile::open(gguf).unwrap_or_else(|e| panic!("{}: {e}", gguf.display()));
    let start = Instant::now();
    let tokenizer =
        Tokenizer::from_gguf(&file).unwrap_or_else(|e| panic!("{}: {e}", gguf.display()));
    println!(
        "{}: vocab {} merges {} built in {:?}",
        gguf.display(),
        tokenizer.vocab_size(),
        tokenizer.merge_count(),
        start.elapsed()
    );
    tokenizer
}

/// Checks every `tokenize.entries[]` item of a fixture's golden.json against `gguf`'s tokenizer.
fn check_fixture(fixture: &str, gguf_name: &str) {
    let Some(golden) = nextn_testdata::shared("golden") else {
        return;
    };
    let dir = golden.join(fixture);
    let golden = load_json(&dir.join("golden.json"));
    let tokenizer = load_tokenizer(&dir.join(gguf_name));

    let entries = golden["tokenize"]["entries"]
        .as_array()
        .expect("tokenize.entries");
    assert!(!entries.is_empty());
    let mut failures = Vec::new();
    for entry in entries {
        let name = entry["name"].as_str().expect("name");
        let text_bytes = hex_decode(entry["text_hex"].as_str().expect("text_hex"));
        let text = String::from_utf8(text_bytes).expect("probe text is UTF-8");

        let with_special = tokenizer.encode(&text, true);
        let expected_special = ids(&entry["ids_parse_special"]);
        if with_special != expected_special {
            failures.push(format!(
                "{name} (parse_special): got {with_special:?}, llama.cpp {expected_special:?}"
            ));
        }
        let without_special = tokenizer.encode(&text, false);
        let expected_plain = ids(&entry["ids_no_parse_special"]);
        if without_special != expected_plain {
            failures.push(format!(
                "{name} (no parse_special): got {without_special:?}, llama.cpp {expected_plain:?}"
            ));
        }

        let pieces: Vec<Vec<u8>> = entry["pieces_hex"]
            .as_array()
            .expect("pieces_hex")
            .iter()
            .map(|p| hex_decode(p.as_str().expect("piece hex")))
            .collect();
        assert_eq!(
            pieces.len(),
            expected_special.len(),
            "{name}: pieces per id"
        );
        for (id, piece) in expected_special.iter().zip(&pieces) {
            if tokenizer.token_bytes(*id) != piece.as_slice() {
                failures.push(format!(
                    "{name}: piece of {id} is {:?}, llama.cpp {piece:?}",
                    tokenizer.token_bytes(*id)
                ));
            }
        }
        let detok = hex_decode(entry["detok_hex"].as_str().expect("detok_hex"));
        assert_eq!(
            tokenizer.decode_bytes(&expected_special),
            detok,
            "{name}: detokenization"
        );
        if entry["detok_roundtrip_equal"].as_bool() == Some(true) {
            assert_eq!(tokenizer.decode(&with_special), text, "{name}: round trip");
        }
    }
    assert!(
        failures.is_empty(),
        "{fixture}: {} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
    println!("{fixture}: {} entries match llama.cpp", entries.len());
}

#[test]
fn qwen_vocab_matches_llama_cpp() {
    check_fixture(
        "q35-dense-qwenvocab",
        "q35-dense-qwenvocab-F32-embQ8_0.gguf",
    );
}

#[test]
fn small_dense_vocab_matches_llama_cpp() {
    check_fixture("q35-dense-a", "q35-dense-a-F32.gguf");
}

#[test]
fn small_moe_vocabs_match_llama_cpp() {
    check_fixture("q35moe-a", "q35moe-a-F32.gguf");
    check_fixture("q35moe-b", "q35moe-b-F32.gguf");
}

#[test]
fn qwen_vocab_eog_and_specials() {
    let Some(dir) = nextn_testdata::shared("golden/q35-dense-qwenvocab") else {
        return;
    };
    let tokenizer = load_tokenizer(&dir.join("q35-dense-qwenvocab-F32-embQ8_0.gguf"));
    let golden = load_json(&dir.join("golden.json"));
    let variants = golden["variants"].as_object().expect("variants");
    let (_, variant) = variants.iter().next().expect("a variant");
    let mut expected_eog = ids(&variant["eog_ids"]);
    expected_eog.sort_unstable();
    assert_eq!(tokenizer.eog_ids(), expected_eog.as_slice());
    assert_eq!(tokenizer.eos(), tokenizer.token_id("<|im_end|>"));
    assert!(!tokenizer.add_bos());
    assert_eq!(tokenizer.model_name(), "gpt2");
    assert_eq!(tokenizer.pre_name(), "qwen35");
    assert_eq!(tokenizer.vocab_size(), 248320);
    // Padding rows of the embedding have no text.
    assert_eq!(tokenizer.token_bytes(248100), b"");
    for control in [
        "<|fim_prefix|>",
        "<|repo_name|>",
        "<|file_sep|>",
        "<|im_start|>",
    ] {
        let id = tokenizer.token_id(control).expect(control);
        assert!(tokenizer.is_control(id), "{control}");
    }
    let think = tokenizer.token_id("<think>").expect("<think>");
    assert!(!tokenizer.is_control(think));
}

#[test]
fn tiny_model_prompts_match_reference_ids() {
    let Some(dir) = nextn_testdata::shared("models/tiny-qwen35-mtp") else {
        return;
    };
    let tokenizer = load_tokenizer(&dir.join("tiny-qwen35-mtp-F32.gguf"));
    let golden = load_json(&dir.join("golden_jax.json"));
    let goldens = golden["goldens"].as_array().expect("goldens");
    assert!(!goldens.is_empty());
    for g in goldens {
        let prompt = g["prompt"].as_str().expect("prompt");
        assert_eq!(
            tokenizer.encode(prompt, true),
            ids(&g["prompt_ids"]),
            "prompt {prompt:?}"
        );
        assert_eq!(tokenizer.decode(&ids(&g["prompt_ids"])), prompt);
    }
    assert_eq!(tokenizer.eog_ids(), [8189, 8191]);
}
