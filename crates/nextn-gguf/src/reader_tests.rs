//! Hand-assembled files, valid and broken, checked field by field.

use crate::value::type_id as vt;
use crate::{GgmlType, GgufError, GgufFile, GgufWriter, MetadataArray, MetadataValue};

/// Assembles GGUF bytes field by field, so tests can write what no writer would.
struct Raw(Vec<u8>);

impl Raw {
    fn header(version: u32, n_tensors: u64, n_kv: u64) -> Raw {
        let mut r = Raw(b"GGUF".to_vec());
        r.u32(version).u64(n_tensors).u64(n_kv);
        r
    }
    fn u32(&mut self, x: u32) -> &mut Self {
        self.0.extend_from_slice(&x.to_le_bytes());
        self
    }
    fn u64(&mut self, x: u64) -> &mut Self {
        self.0.extend_from_slice(&x.to_le_bytes());
        self
    }
    fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
    fn str(&mut self, s: &[u8]) -> &mut Self {
        self.u64(s.len() as u64).bytes(s)
    }
    fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.str(key.as_bytes()).u32(vt::U32).u32(v)
    }
    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.str(name.as_bytes()).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(ty).u64(offset)
    }
    /// Zero padding up to the next multiple of `a`, then `n` data bytes.
    fn pad_and_data(&mut self, a: usize, n: usize) -> &mut Self {
        let padded = self.0.len().next_multiple_of(a);
        self.0.resize(padded, 0);
        self.0.extend((0..n).map(|i| i as u8));
        self
    }
    fn parse(&self) -> Result<GgufFile, GgufError> {
        GgufFile::from_bytes(self.0.clone())
    }
}

fn err(r: &Raw) -> GgufError {
    match r.parse() {
        Ok(_) => panic!("parse unexpectedly succeeded"),
        Err(e) => e,
    }
}

/// Every value type, nested arrays and two tensors, written by our writer.
fn small_rich_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.add_kv("s", "str");
    w.add_kv("u8", MetadataValue::U8(1));
    w.add_kv("i16", MetadataValue::I16(-2));
    w.add_kv("f64", MetadataValue::F64(2.5));
    w.add_kv("b", MetadataValue::Bool(false));
    w.add_kv("as", MetadataArray::String(vec!["a".into(), "bc".into()]));
    w.add_kv("af", MetadataArray::F32(vec![1.0, 2.0]));
    w.add_kv(
        "aa",
        MetadataArray::Array(vec![MetadataArray::Bool(vec![true])]),
    );
    w.add_tensor("t0", vec![4, 2], GgmlType::F32, vec![3u8; 32])
        .unwrap();
    w.add_tensor("t1", vec![32], GgmlType::Q8_0, vec![4u8; 34])
        .unwrap();
    w.to_bytes().unwrap()
}

/// One tensor named `t`, no metadata, followed by `data` bytes after the padding.
fn one_tensor_file(ty: u32, dims: &[u64], offset: u64, data: usize) -> Raw {
    let mut r = Raw::header(3, 1, 0);
    r.tensor("t", dims, ty, offset).pad_and_data(32, data);
    r
}

#[test]
fn minimal_files_parse() {
    let mut r = Raw::header(3, 0, 0);
    let f = r.parse().unwrap();
    assert_eq!((f.version(), f.alignment(), f.tensors().len()), (3, 32, 0));
    r = one_tensor_file(0, &[4], 0, 16);
    let f = r.parse().unwrap();
    let t = &f.tensors()[0];
    assert_eq!((t.n_elements, t.n_bytes, t.file_offset), (4, 16, 64));
    assert_eq!(
        f.tensor_data(t),
        &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
    );
    assert_eq!(f.data_start(0), Some(64));
    // Version 2 has the same layout.
    r.0[4] = 2;
    assert_eq!(r.parse().unwrap().version(), 2);
}

#[test]
fn header_errors() {
    let e = err(&Raw(b"GGUX\x03\0\0\0".to_vec()));
    assert!(
        matches!(e, GgufError::BadMagic { found } if &found == b"GGUX"),
        "{e}"
    );
    let e = err(&Raw::header(1, 0, 0));
    assert!(e.to_string().contains("unsupported GGUF version 1"), "{e}");
    let e = err(&Raw::header(4, 0, 0));
    assert!(matches!(e, GgufError::UnsupportedVersion { version: 4 }));
    let e = err(&Raw::header(3u32.swap_bytes(), 0, 0));
    assert!(matches!(e, GgufError::BigEndian { version: 3 }), "{e}");
    let e = err(&Raw(b"GG".to_vec()));
    assert!(
        matches!(
            e,
            GgufError::Truncated {
                offset: 0,
                needed: 4,
                available: 2,
                ..
            }
        ),
        "{e}"
    );
    let e = err(&Raw::header(3, 1 << 40, 0));
    assert!(
        matches!(e, GgufError::CountTooLarge { what: "tensor", count, offset: 8, .. } if count == 1 << 40),
        "{e}"
    );
    let e = err(&Raw::header(3, 0, u64::MAX));
    assert!(
        matches!(
            e,
            GgufError::CountTooLarge {
                what: "metadata key-value",
                offset: 16,
                ..
            }
        ),
        "{e}"
    );
    // Each count alone fits, together they do not.
    let mut r = Raw::header(3, 1, 2);
    r.bytes(&[0; 40]);
    assert!(matches!(err(&r), GgufError::CountTooLarge { .. }));
}

#[test]
fn alignment_is_validated() {
    for bad in [0u32, 48, 3] {
        let mut r = Raw::header(3, 0, 1);
        r.kv_u32("general.alignment", bad);
        let e = err(&r);
        assert!(
            matches!(e, GgufError::BadAlignment { ref key, value } if key == "general.alignment" && value == bad as u64),
            "{e}"
        );
        assert!(e.to_string().contains("general.alignment"));
    }
    let mut r = Raw::header(3, 0, 1);
    r.str(b"general.alignment").u32(vt::STRING).str(b"64");
    assert!(
        matches!(err(&r), GgufError::MetadataType { ref key, .. } if key == "general.alignment")
    );
    // Any integer type is accepted, and a different alignment moves the data section.
    let mut r = Raw::header(3, 1, 1);
    r.str(b"general.alignment").u32(vt::U64).u64(128);
    r.tensor("t", &[4], 0, 0).pad_and_data(128, 16);
    let f = r.parse().unwrap();
    assert_eq!((f.alignment(), f.tensors()[0].file_offset), (128, 128));
}

#[test]
fn metadata_errors_name_key_and_offset() {
    let mut r = Raw::header(3, 0, 1);
    r.str(b"k").u32(13).u32(0);
    let e = err(&r);
    assert!(
        matches!(e, GgufError::UnknownValueType { ref key, type_id: 13, offset: 33 } if key == "k"),
        "{e}"
    );

    let mut r = Raw::header(3, 0, 1);
    r.str(b"k\xff").u32(vt::U8).bytes(&[1]);
    assert!(matches!(err(&r), GgufError::InvalidUtf8 { offset: 32, .. }));

    let mut r = Raw::header(3, 0, 1);
    r.str(b"k").u32(vt::STRING).str(b"\xc3\x28");
    let e = err(&r);
    assert!(
        matches!(e, GgufError::InvalidUtf8 { ref what, offset: 45 } if what.contains("\"k\"")),
        "{e}"
    );

    let mut r = Raw::header(3, 0, 1);
    r.str(b"k").u32(vt::STRING).u64(1 << 50);
    let e = err(&r);
    assert!(
        matches!(e, GgufError::LengthTooLarge { len, offset: 37, .. } if len == 1 << 50),
        "{e}"
    );

    let mut r = Raw::header(3, 0, 1);
    r.str(b"k")
        .u32(vt::ARRAY)
        .u32(vt::STRING)
        .u64(1 << 40)
        .bytes(&[0; 16]);
    let e = err(&r);
    assert!(
        matches!(e, GgufError::LengthTooLarge { ref what, .. } if what.contains("\"k\"")),
        "{e}"
    );

    let mut r = Raw::header(3, 0, 1);
    r.str(b"k").u32(vt::ARRAY).u32(99).u64(0);
    assert!(matches!(
        err(&r),
        GgufError::UnknownValueType { type_id: 99, .. }
    ));

    let mut r = Raw::header(3, 0, 1);
    r.str(b"k").u32(vt::BOOL).bytes(&[2]);
    assert!(matches!(
        err(&r),
        GgufError::InvalidBool {
            value: 2,
            offset: 37,
            ..
        }
    ));

    let mut r = Raw::header(3, 0, 2);
    r.kv_u32("k", 1).kv_u32("k", 2);
    let e = err(&r);
    assert!(
        matches!(e, GgufError::DuplicateKey { ref key, offset: 41 } if key == "k"),
        "{e}"
    );

    // Arrays of arrays nested past the limit.
    let mut r = Raw::header(3, 0, 1);
    r.str(b"k").u32(vt::ARRAY);
    for _ in 0..crate::MAX_ARRAY_DEPTH {
        r.u32(vt::ARRAY).u64(1);
    }
    r.u32(vt::U8).u64(0);
    assert!(matches!(err(&r), GgufError::NestingTooDeep { .. }));
}

#[test]
fn tensor_info_errors() {
    let e = err(&one_tensor_file(4, &[4], 0, 16));
    assert_eq!(
        e.to_string(),
        "unknown ggml type id 4 in tensor \"t\" at byte 45"
    );
    let e = err(&one_tensor_file(0, &[1, 1, 1, 1, 1], 0, 4));
    assert!(
        matches!(e, GgufError::TensorDimCount { n_dims: 5, .. }),
        "{e}"
    );
    let e = err(&one_tensor_file(0, &[], 0, 4));
    assert!(
        matches!(e, GgufError::TensorDimCount { n_dims: 0, .. }),
        "{e}"
    );
    let e = err(&one_tensor_file(0, &[4, 0], 0, 4));
    assert!(
        matches!(
            e,
            GgufError::TensorDim {
                index: 1,
                value: 0,
                ..
            }
        ),
        "{e}"
    );
    let e = err(&one_tensor_file(0, &[u64::MAX], 0, 4));
    assert!(
        matches!(
            e,
            GgufError::TensorDim {
                value: u64::MAX,
                ..
            }
        ),
        "{e}"
    );
    let e = err(&one_tensor_file(0, &[1 << 32, 1 << 32], 0, 4));
    assert!(
        matches!(e, GgufError::ElementCountOverflow { ref tensor, .. } if tensor == "t"),
        "{e}"
    );
    // n_elements fits but the byte size (x4) does not.
    let e = err(&one_tensor_file(0, &[1 << 31, 1 << 31], 0, 4));
    assert!(
        matches!(
            e,
            GgufError::TensorOutOfBounds { .. } | GgufError::ElementCountOverflow { .. }
        ),
        "{e}"
    );
    let e = err(&one_tensor_file(GgmlType::Q8_0.id(), &[33], 0, 64));
    assert!(
        matches!(
            e,
            GgufError::PartialBlock {
                ne0: 33,
                block_size: 32,
                ..
            }
        ),
        "{e}"
    );
    let e = err(&one_tensor_file(0, &[4], 8, 64));
    assert!(
        matches!(
            e,
            GgufError::MisalignedTensor {
                data_offset: 8,
                alignment: 32,
                ..
            }
        ),
        "{e}"
    );
    let e = err(&one_tensor_file(0, &[4], 0, 15));
    assert!(
        matches!(e, GgufError::TensorOutOfBounds { n_bytes: 16, .. }),
        "{e}"
    );
    let e = err(&one_tensor_file(0, &[4], u64::MAX - 31, 16));
    assert!(matches!(e, GgufError::TensorOutOfBounds { .. }), "{e}");

    let mut r = Raw::header(3, 1, 0);
    r.tensor(&"x".repeat(64), &[4], 0, 0).pad_and_data(32, 16);
    assert!(matches!(
        err(&r),
        GgufError::TensorNameTooLong { len: 64, .. }
    ));

    let mut r = Raw::header(3, 2, 0);
    r.tensor("a", &[4], 0, 0)
        .tensor("a", &[4], 0, 32)
        .pad_and_data(32, 64);
    assert!(matches!(err(&r), GgufError::DuplicateTensor { ref tensor, .. } if tensor == "a"));

    let mut r = Raw::header(3, 2, 0);
    r.tensor("a", &[16], 0, 0)
        .tensor("b", &[4], 0, 32)
        .pad_and_data(32, 64);
    let e = err(&r);
    assert!(
        matches!(e, GgufError::TensorOverlap { ref first, ref second, first_end: 64, second_start: 32, .. }
            if first == "a" && second == "b"),
        "{e}"
    );
}

#[test]
fn exotic_types_only_need_block_geometry() {
    for ty in GgmlType::all() {
        let ne0 = ty.block_size() as u64 * 2;
        let n = ty.row_bytes(ne0).unwrap() as usize * 3;
        let f = one_tensor_file(ty.id(), &[ne0, 3], 0, n).parse().unwrap();
        assert_eq!(f.tensors()[0].ty, ty);
        assert_eq!(f.tensors()[0].n_bytes as usize, n);
    }
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = small_rich_file();
    let f = GgufFile::from_bytes(bytes.clone()).unwrap();
    // Dropping the final tensor's trailing padding still leaves a complete file.
    let data_end = f
        .tensors()
        .iter()
        .map(|t| t.file_offset + t.n_bytes)
        .max()
        .unwrap();
    assert!(data_end < bytes.len() as u64);
    for len in data_end as usize..bytes.len() {
        let g = GgufFile::from_bytes(bytes[..len].to_vec()).unwrap();
        assert_eq!(GgufWriter::from_file(&g).to_bytes().unwrap(), &bytes[..len]);
    }
    for len in 0..data_end as usize {
        let e = GgufFile::from_bytes(bytes[..len].to_vec()).unwrap_err();
        assert!(
            matches!(
                e,
                GgufError::Truncated { .. }
                    | GgufError::LengthTooLarge { .. }
                    | GgufError::CountTooLarge { .. }
                    | GgufError::TensorOutOfBounds { .. }
            ),
            "prefix {len}: {e}"
        );
    }
}

#[test]
fn odd_layouts_round_trip_exactly() {
    // Non-zero header padding, tensors stored in reverse order with a garbage gap, trailing bytes.
    let mut r = Raw::header(3, 2, 1);
    r.kv_u32("x", 5)
        .tensor("a", &[4], 0, 64)
        .tensor("b", &[8], 0, 0);
    let padded = r.0.len().next_multiple_of(32);
    r.0.resize(padded, 0xAB);
    r.bytes(&[1; 32])
        .bytes(&[0xEE; 32])
        .bytes(&[2; 16])
        .bytes(b"tail");
    let f = r.parse().unwrap();
    assert_eq!(f.tensor_data_by_name("a").unwrap(), &[2; 16]);
    assert_eq!(f.tensor_data_by_name("b").unwrap(), &[1; 32]);
    let w = GgufWriter::from_file(&f);
    assert_eq!(w.to_bytes().unwrap(), r.0);

    // Changing metadata keeps data offsets; padding becomes zeros, the rest is kept.
    let mut w = GgufWriter::from_file(&f);
    w.set_kv("y", MetadataValue::String("longer header".into()));
    let g = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    assert_eq!(g.tensor("a").unwrap().offset, 64);
    assert_eq!(g.tensor_data_by_name("a").unwrap(), &[2; 16]);
    assert_eq!(g.get_str("y").unwrap(), Some("longer header"));

    // A tensor-less file that stops before its padding ends.
    let mut r = Raw::header(3, 0, 1);
    r.kv_u32("x", 5).bytes(&[0, 0, 0]);
    let f = r.parse().unwrap();
    assert_eq!(GgufWriter::from_file(&f).to_bytes().unwrap(), r.0);
}

#[test]
fn typed_accessors() {
    let mut w = GgufWriter::new();
    w.add_kv("neg", MetadataValue::I64(-1));
    w.add_kv("big", MetadataValue::U64(1 << 33));
    w.add_kv("small", MetadataValue::U8(9));
    w.add_kv("f", MetadataValue::F64(0.25));
    w.add_kv("arr", MetadataArray::U16(vec![1, 2]));
    let f = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    assert_eq!(f.get_u32("small").unwrap(), Some(9));
    assert_eq!(f.get_u64("big").unwrap(), Some(1 << 33));
    let e = f.get_u32("big").unwrap_err();
    assert_eq!(
        e.to_string(),
        "metadata key \"big\": expected an integer fitting in u32, found u64 8589934592"
    );
    assert!(f.get_u64("neg").is_err());
    assert_eq!(f.get_i64("neg").unwrap(), Some(-1));
    assert_eq!(f.get_f32("f").unwrap(), Some(0.25));
    assert!(f.get_f32("small").is_err());
    assert!(f.get_bool("small").is_err());
    assert!(f.get_str("arr").is_err());
    assert_eq!(f.get_u32("missing").unwrap(), None);
    assert_eq!(
        f.get_array("arr").unwrap().unwrap().as_u32_vec(),
        Some(vec![1, 2])
    );
    assert_eq!(f.metadata().len(), 5);
    assert_eq!(f.metadata()[2].0, "small");
}
