use std::time::Instant;
#[test]
fn bench_build() {
    let p = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/golden/q35-dense-qwenvocab/q35-dense-qwenvocab-F32-embQ8_0.gguf");
    let t0 = Instant::now();
    let f = nextn_gguf::GgufFile::open(p).unwrap();
    eprintln!("open {:?}", t0.elapsed());
    let t0 = Instant::now();
    let tok = nextn_engine::tokenizer::Tokenizer::from_gguf(&f).unwrap();
    eprintln!("new {:?}", t0.elapsed());
    let text = std::fs::read_to_string("/root/.pyenv/versions/3.11.7/lib/python3.11/json/decoder.py").unwrap().repeat(20);
    let t0 = Instant::now();
    let ids = tok.encode(&text, true);
    let dt = t0.elapsed();
    eprintln!("encode {} bytes -> {} ids in {:?}: {:.2} MB/s", text.len(), ids.len(), dt, text.len() as f64 / dt.as_secs_f64() / 1e6);
    let zh = "人力资源和社会保障部，你好世界！这是一个测试。".repeat(2000);
    let t0 = Instant::now();
    let ids = tok.encode(&zh, true);
    let dt = t0.elapsed();
    eprintln!("encode zh {} bytes -> {} ids in {:?}: {:.2} MB/s", zh.len(), ids.len(), dt, zh.len() as f64 / dt.as_secs_f64() / 1e6);
}
