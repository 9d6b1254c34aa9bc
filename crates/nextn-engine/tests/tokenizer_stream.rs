//! Streaming detokenization on the real Qwen vocabulary: byte-level tokens split multi-byte
//! characters (emoji, CJK, Indic), and the stream must only ever emit whole characters.

use nextn_engine::tokenizer::Tokenizer;
use nextn_gguf::GgufFile;
use serde_json::Value;

#[test]
fn streaming_golden_probes_emits_whole_characters() {
    let Some(dir) = nextn_testdata::shared("golden/q35-dense-qwenvocab") else {
        return;
    };
    let file = GgufFile::open(dir.join("q35-dense-qwenvocab-F32-embQ8_0.gguf")).expect("open");
    let tokenizer = Tokenizer::from_gguf(&file).expect("tokenizer");
    let golden: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).expect("read"))
            .expect("json");

    let mut split_characters = 0;
    for entry in golden["tokenize"]["entries"].as_array().expect("entries") {
        let name = entry["name"].as_str().expect("name");
        let ids: Vec<u32> =
            serde_json::from_value(entry["ids_parse_special"].clone()).expect("ids");
        let text = tokenizer.decode(&ids);
        let mut decoder = tokenizer.stream_decoder();
        let mut streamed = String::new();
        for &id in &ids {
            let piece = decoder.push(id);
            if std::str::from_utf8(tokenizer.token_bytes(id)).is_err() {
                split_characters += 1;
            }
            // Whatever came out so far is a prefix of the full text: nothing was emitted early.
            streamed.push_str(&piece);
            assert!(
                text.starts_with(&streamed),
                "{name}: {streamed:?} is not a prefix of {text:?}"
            );
        }
        streamed.push_str(&decoder.flush());
        assert_eq!(streamed, text, "{name}");
        assert!(
            !streamed.contains('\u{FFFD}'),
            "{name}: replacement character in a valid text"
        );
    }
    assert!(
        split_characters > 10,
        "the probes should include tokens holding partial characters"
    );
}

#[test]
fn generated_tokens_stream_like_decode() {
    let Some(dir) = nextn_testdata::shared("golden/q35-dense-qwenvocab") else {
        return;
    };
    let file = GgufFile::open(dir.join("q35-dense-qwenvocab-F32-embQ8_0.gguf")).expect("open");
    let tokenizer = Tokenizer::from_gguf(&file).expect("tokenizer");
    let golden: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).expect("read"))
            .expect("json");
    // Random-weight greedy outputs: arbitrary byte-level tokens, often invalid UTF-8 in sequence.
    let streamed = &golden["server_mtp"]["completions"];
    let mut checked = 0;
    for (_, completion) in streamed.as_object().expect("completions") {
        let ids: Vec<u32> =
            serde_json::from_value(completion["streamed_tokens"].clone()).expect("ids");
        let mut decoder = tokenizer.stream_decoder();
        let mut text: String = ids.iter().map(|&id| decoder.push(id)).collect();
        text.push_str(&decoder.flush());
        assert_eq!(text, tokenizer.decode(&ids));
        checked += 1;
    }
    assert!(checked >= 2);
}
