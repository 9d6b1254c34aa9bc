//! Any input: the parser returns Ok or a typed error; an accepted input rewrites to itself
//! byte for byte and its canonical re-layout parses again.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nextn_gguf::{GgufFile, GgufWriter};

fuzz_target!(|data: &[u8]| {
    let Ok(f) = GgufFile::from_bytes(data.to_vec()) else {
        return;
    };
    for t in f.tensors() {
        assert_eq!(f.tensor_data(t).len() as u64, t.n_bytes);
    }
    let rewritten = GgufWriter::from_file(&f).to_bytes().expect("rewrite of an accepted file");
    assert!(rewritten == data, "rewrite differs from the input");
    let mut canonical = GgufWriter::from_file(&f);
    canonical.discard_preserved_layout();
    let bytes = canonical.to_bytes().expect("canonical write");
    GgufFile::from_bytes(bytes).expect("canonical re-layout parses");
});
