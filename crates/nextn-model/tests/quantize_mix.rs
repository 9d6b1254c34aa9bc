//! The type llama-quantize chose for every tensor of the quantized golden fixtures (made from the
//! F32 files by llama.cpp's llama-quantize; the commands are in each fixture's golden.json) is the
//! type `nextn quantize`'s mix chooses, and the tensors come in the same order.

use nextn_gguf::{GgmlType, GgufFile};
use nextn_model::config::Qwen35Config;
use nextn_model::quantize::{self, mix, FileType, MixOptions};

#[test]
fn mix_matches_llama_quantize_on_the_fixtures() {
    let Some(golden) = nextn_testdata::shared("golden") else {
        return;
    };
    let cases = [
        ("q35-dense-a", "F16"),
        ("q35-dense-a", "BF16"),
        ("q35-dense-a", "Q8_0"),
        ("q35-dense-a", "Q4_K_M"),
        ("q35-dense-a", "Q5_K_M"),
        ("q35-dense-a", "Q6_K"),
        ("q35-dense-a", "IQ4_XS"),
        ("q35moe-a", "Q8_0"),
        ("q35moe-a", "Q4_K_M"),
    ];
    for (fixture, ty) in cases {
        let dir = golden.join(fixture);
        let src = GgufFile::open(dir.join(format!("{fixture}-F32.gguf"))).expect("F32 fixture");
        let made = GgufFile::open(dir.join(format!("{fixture}-{ty}.gguf"))).expect("fixture");
        let ftype = FileType::parse(ty).expect("file type");
        let cfg = Qwen35Config::from_gguf(&src).expect("config");
        let mut names: Vec<String> = src.tensors().iter().map(|t| t.name.clone()).collect();
        mix::llama_order(&mut names);
        let made_order: Vec<&str> = made.tensors().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, made_order, "{fixture} {ty}: tensor order");
        let listed: Vec<(String, Vec<u64>, GgmlType)> = names
            .iter()
            .map(|n| {
                let t = src.tensor(n).expect("tensor");
                (n.clone(), t.dims.clone(), t.ty)
            })
            .collect();
        let types = mix::choose_types(
            &listed,
            ftype,
            quantize::model_facts(&cfg),
            &MixOptions::default(),
        );
        let wrong: Vec<String> = listed
            .iter()
            .zip(&types)
            .filter_map(|((n, _, _), &ours)| {
                let theirs = made.tensor(n).expect("tensor").ty;
                (ours != theirs).then(|| format!("{n}: ours {ours}, llama-quantize {theirs}"))
            })
            .collect();
        assert!(wrong.is_empty(), "{fixture} {ty}:\n{}", wrong.join("\n"));
    }
}
