use super::*;

/// A small vocabulary: the 256 byte tokens (id = byte), the products of `merges` in order, then
/// `specials` with their GGUF types.
fn spec(merges: &[&str], specials: &[(&str, i32)]) -> TokenizerSpec {
    let chars = unicode::byte_to_char_table();
    let mut tokens: Vec<String> = chars.iter().map(|c| c.to_string()).collect();
    for m in merges {
        tokens.push(m.replace(' ', ""));
    }
    let mut types = vec![1; tokens.len()];
    for (text, ty) in specials {
        tokens.push(text.to_string());
        types.push(*ty);
    }
    TokenizerSpec {
        model: "gpt2".into(),
        pre: Some("qwen35".into()),
        tokens,
        token_types: Some(types),
        merges: merges.iter().map(|s| s.to_string()).collect(),
        ..TokenizerSpec::default()
    }
}

fn hello_tokenizer() -> Tokenizer {
    // 256 Ġh, 257 Ġhe, 258 ll, 259 Ġhell, 260 Ġhello; specials from 261.
    let merges = ["Ġ h", "Ġh e", "l l", "Ġhe ll", "Ġhell o"];
    let specials = [
        ("<|im_start|>", 3),
        ("<|im_end|>", 3),
        ("<think>", 4),
        ("<|fim_pad|>", 4),
    ];
    let mut s = spec(&merges, &specials);
    s.eos = Some(262);
    Tokenizer::new(s).expect("valid spec")
}

#[test]
fn encodes_with_merges_and_specials() {
    let t = hello_tokenizer();
    assert_eq!(t.encode(" hello", false), [260]);
    assert_eq!(
        t.encode("hello", false),
        [b'h' as u32, b'e' as u32, 258, b'o' as u32]
    );
    // Control tokens are text unless parse_special; user-defined ones always match.
    assert_eq!(t.encode("<|im_end|>", true), [262]);
    assert_eq!(t.encode("<think> hello", false), [263, 260]);
    let literal = t.encode("<|im_end|>", false);
    assert!(!literal.contains(&262));
    assert_eq!(t.decode(&literal), "<|im_end|>");
    // <|fim_pad|> is retyped to control, so it is no longer matched without parse_special.
    assert!(t.is_control(264));
    assert!(!t.encode("<|fim_pad|>", false).contains(&264));
    assert_eq!(t.encode("<|fim_pad|>", true), [264]);
}

#[test]
fn decode_renders_specials_and_bytes() {
    let t = hello_tokenizer();
    let ids = t.encode("<|im_start|> hello\n<|im_end|>", true);
    assert_eq!(ids, [261, 260, b'\n' as u32, 262]);
    assert_eq!(t.decode(&ids), "<|im_start|> hello\n<|im_end|>");
    assert_eq!(t.token_bytes(260), b" hello");
    assert_eq!(t.token_bytes(u32::MAX), b"");
    assert_eq!(t.token_id("Ġhello"), Some(260));
    assert_eq!(t.token_text(262), Some("<|im_end|>"));
}

#[test]
fn end_of_generation_set() {
    let t = hello_tokenizer();
    assert_eq!(t.eos(), Some(262));
    assert!(t.is_eog(262));
    assert!(t.is_eog(264)); // <|fim_pad|>
    assert!(!t.is_eog(261));
    assert!(!t.is_eog(260));
}

#[test]
fn rejects_bad_specs() {
    let mut s = spec(&[], &[]);
    s.model = "llama".into();
    assert!(matches!(
        Tokenizer::new(s),
        Err(TokenizerError::UnsupportedModel(_))
    ));
    let mut s = spec(&[], &[]);
    s.pre = Some("mystery".into());
    assert!(matches!(
        Tokenizer::new(s),
        Err(TokenizerError::UnsupportedPreTokenizer(_))
    ));
    let mut s = spec(&[], &[]);
    s.tokens.push("a".into());
    s.token_types = None;
    assert!(matches!(
        Tokenizer::new(s),
        Err(TokenizerError::DuplicateToken { .. })
    ));
    let mut s = spec(&[], &[]);
    s.add_bos = true;
    assert!(matches!(Tokenizer::new(s), Err(TokenizerError::MissingBos)));
    let mut s = spec(&[], &[]);
    s.token_types = Some(vec![1; 3]);
    assert!(matches!(
        Tokenizer::new(s),
        Err(TokenizerError::TokenTypeCount { .. })
    ));
}

#[test]
fn adds_bos_when_asked() {
    let mut s = spec(&[], &[("<s>", 3)]);
    s.bos = Some(256);
    s.add_bos = true;
    let t = Tokenizer::new(s).expect("valid spec");
    assert_eq!(t.encode("", false), [256]);
    assert_eq!(t.encode("a", false), [256, b'a' as u32]);
}

#[test]
fn stream_decoder_holds_back_partial_characters() {
    let t = hello_tokenizer();
    // "é" = C3 A9 and "中" = E4 B8 AD arrive one byte token at a time.
    let mut d = t.stream_decoder();
    assert_eq!(d.push(0xC3), "");
    assert_eq!(d.push(0xA9), "é");
    assert_eq!(d.push(0xE4), "");
    assert_eq!(d.push(0xB8), "");
    assert_eq!(d.pending_bytes(), [0xE4, 0xB8]);
    assert_eq!(d.push(0xAD), "中");
    assert_eq!(d.push(260), " hello");
    // An invalid continuation: the held-back lead byte becomes U+FFFD, the rest comes through.
    assert_eq!(d.push(0xE4), "");
    assert_eq!(d.push(b'A' as u32), "\u{FFFD}A");
    // A truncated character at the end of the stream.
    assert_eq!(d.push(0xF0), "");
    assert_eq!(d.flush(), "\u{FFFD}");
    assert_eq!(d.flush(), "");
}

#[test]
fn stream_output_equals_lossy_decode() {
    let t = hello_tokenizer();
    // Pseudo-random byte-token sequences, valid and invalid UTF-8 mixed.
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    for _ in 0..200 {
        let mut ids = Vec::new();
        for _ in 0..12 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ids.push((state % 265) as u32);
        }
        let mut d = t.stream_decoder();
        let mut streamed: String = ids.iter().map(|&id| d.push(id)).collect();
        streamed.push_str(&d.flush());
        assert_eq!(streamed, t.decode(&ids), "ids {ids:?}");
    }
}

mod from_gguf {
    use super::*;
    use nextn_gguf::{GgufFile, GgufWriter, MetadataArray, MetadataValue};

    fn strings(items: &[String]) -> MetadataValue {
        MetadataArray::String(items.to_vec()).into()
    }

    fn writer_for(spec: &TokenizerSpec) -> GgufWriter<'static> {
        let mut w = GgufWriter::new();
        w.add_kv(
            "tokenizer.ggml.model",
            MetadataValue::String(spec.model.clone()),
        );
        w.add_kv("tokenizer.ggml.pre", MetadataValue::String("qwen35".into()));
        w.add_kv("tokenizer.ggml.tokens", strings(&spec.tokens));
        w.add_kv(
            "tokenizer.ggml.token_type",
            MetadataValue::from(MetadataArray::I32(
                spec.token_types.clone().unwrap_or_default(),
            )),
        );
        w.add_kv("tokenizer.ggml.merges", strings(&spec.merges));
        w.add_kv("tokenizer.ggml.eos_token_id", MetadataValue::U32(262));
        w.add_kv("tokenizer.ggml.add_bos_token", MetadataValue::Bool(false));
        w
    }

    fn open(w: &GgufWriter) -> GgufFile {
        GgufFile::from_bytes(w.to_bytes().expect("serialises")).expect("parses")
    }

    fn hello_spec() -> TokenizerSpec {
        let merges = ["Ġ h", "Ġh e", "l l", "Ġhe ll", "Ġhell o"];
        spec(&merges, &[("<|im_start|>", 3), ("<|im_end|>", 3)])
    }

    #[test]
    fn reads_the_tokenizer_keys() {
        let file = open(&writer_for(&hello_spec()));
        let spec = TokenizerSpec::from_gguf(&file).expect("spec");
        assert_eq!(spec.pre.as_deref(), Some("qwen35"));
        assert_eq!(spec.merges.len(), 5);
        assert_eq!(spec.eos, Some(262));
        assert_eq!(spec.bos, None);
        let t = Tokenizer::from_gguf(&file).expect("tokenizer");
        assert_eq!(t.encode(" hello<|im_end|>", true), [260, 262]);
        assert!(t.is_eog(262));
    }

    #[test]
    fn reports_missing_and_mistyped_keys() {
        let mut w = writer_for(&hello_spec());
        w.remove_kv("tokenizer.ggml.merges");
        let err = Tokenizer::from_gguf(&open(&w)).unwrap_err();
        assert!(
            matches!(
                err,
                TokenizerError::MissingKey {
                    key: "tokenizer.ggml.merges"
                }
            ),
            "{err}"
        );

        let mut w = writer_for(&hello_spec());
        w.set_kv(
            "tokenizer.ggml.tokens",
            MetadataValue::from(MetadataArray::U32(vec![1, 2])),
        );
        let err = Tokenizer::from_gguf(&open(&w)).unwrap_err();
        assert!(err.to_string().contains("tokenizer.ggml.tokens"), "{err}");

        let mut w = writer_for(&hello_spec());
        w.set_kv(
            "tokenizer.ggml.eos_token_id",
            MetadataValue::String("x".into()),
        );
        let err = Tokenizer::from_gguf(&open(&w)).unwrap_err();
        assert!(err.to_string().contains("eos_token_id"), "{err}");

        let mut w = writer_for(&hello_spec());
        w.set_kv(
            "tokenizer.ggml.model",
            MetadataValue::String("llama".into()),
        );
        assert!(matches!(
            Tokenizer::from_gguf(&open(&w)),
            Err(TokenizerError::UnsupportedModel(_))
        ));
    }
}

#[test]
fn tokenizer_is_shareable_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
    let t = std::sync::Arc::new(hello_tokenizer());
    let handles: Vec<_> = (0..2)
        .map(|_| {
            let t = t.clone();
            std::thread::spawn(move || t.encode(" hello", false))
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().expect("thread"), [260]);
    }
}
