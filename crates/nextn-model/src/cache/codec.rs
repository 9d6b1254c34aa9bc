//! A plain binary form of cached state (attention rows, recurrent snapshots), little-endian, for
//! files that carry a sequence's state from one process to another (slot files, prompt caches).
//! Every length read is checked against the bytes left before anything is allocated for it, so
//! a truncated or crafted file is an error, never a panic or a huge allocation.

use half::f16;
use nextn_quant::formats::layout::{blocks_as_bytes, blocks_from_bytes, Block, QK32};

use super::{KvBuf, KvRows, KvType, RecurrentSnapshot, RecurrentState};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateCodecError {
    #[error("the state ends early: {what} needs {needed} bytes, {available} are left")]
    Truncated {
        what: &'static str,
        needed: u64,
        available: u64,
    },
    #[error("{what} has the invalid value {value}")]
    Invalid { what: &'static str, value: u64 },
}

/// Appends values to a byte buffer.
#[derive(Default)]
pub struct StateWriter {
    buf: Vec<u8>,
}

impl StateWriter {
    pub fn new() -> Self {
        StateWriter::default()
    }

    pub fn bytes(&mut self, b: &[u8]) {
        self.buf.extend_from_slice(b);
    }

    pub fn u8(&mut self, x: u8) {
        self.buf.push(x);
    }

    pub fn u32(&mut self, x: u32) {
        self.bytes(&x.to_le_bytes());
    }

    pub fn u64(&mut self, x: u64) {
        self.bytes(&x.to_le_bytes());
    }

    /// A length, then the values.
    pub fn u32s(&mut self, xs: &[u32]) {
        self.u64(xs.len() as u64);
        self.buf.reserve(xs.len() * 4);
        for x in xs {
            self.bytes(&x.to_le_bytes());
        }
    }

    /// A length, then the values (their exact bits).
    pub fn f32s(&mut self, xs: &[f32]) {
        self.u64(xs.len() as u64);
        self.buf.reserve(xs.len() * 4);
        for x in xs {
            self.bytes(&x.to_bits().to_le_bytes());
        }
    }

    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    pub fn as_slice(&self) -> &[u8] {
        &self.buf
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.buf
    }
}

/// Reads values back in the order a [`StateWriter`] wrote them.
pub struct StateReader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> StateReader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        StateReader { buf, pos: 0 }
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// Bytes read so far.
    pub fn position(&self) -> usize {
        self.pos
    }

    pub fn take(&mut self, n: u64, what: &'static str) -> Result<&'a [u8], StateCodecError> {
        if n > self.remaining() as u64 {
            return Err(StateCodecError::Truncated {
                what,
                needed: n,
                available: self.remaining() as u64,
            });
        }
        let start = self.pos;
        self.pos += n as usize;
        Ok(&self.buf[start..self.pos])
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], StateCodecError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N as u64, what)?);
        Ok(out)
    }

    pub fn u8(&mut self, what: &'static str) -> Result<u8, StateCodecError> {
        Ok(self.array::<1>(what)?[0])
    }

    pub fn u32(&mut self, what: &'static str) -> Result<u32, StateCodecError> {
        self.array::<4>(what).map(u32::from_le_bytes)
    }

    pub fn u64(&mut self, what: &'static str) -> Result<u64, StateCodecError> {
        self.array::<8>(what).map(u64::from_le_bytes)
    }

    /// A count that must fit in memory as `usize`.
    pub fn count(&mut self, what: &'static str) -> Result<usize, StateCodecError> {
        let n = self.u64(what)?;
        usize::try_from(n).map_err(|_| StateCodecError::Invalid { what, value: n })
    }

    /// `n` elements of `size` bytes each, checked against what is left.
    fn elements(
        &mut self,
        n: u64,
        size: u64,
        what: &'static str,
    ) -> Result<&'a [u8], StateCodecError> {
        let bytes = n
            .checked_mul(size)
            .ok_or(StateCodecError::Invalid { what, value: n })?;
        self.take(bytes, what)
    }

    pub fn u32s(&mut self, what: &'static str) -> Result<Vec<u32>, StateCodecError> {
        let n = self.u64(what)?;
        let raw = self.elements(n, 4, what)?;
        Ok(raw
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    pub fn f32s(&mut self, what: &'static str) -> Result<Vec<f32>, StateCodecError> {
        let n = self.u64(what)?;
        let raw = self.elements(n, 4, what)?;
        Ok(raw
            .chunks_exact(4)
            .map(|c| f32::from_bits(u32::from_le_bytes([c[0], c[1], c[2], c[3]])))
            .collect())
    }
}

impl KvType {
    /// ggml's type id, as in GGUF files.
    pub fn ggml_id(self) -> u8 {
        match self {
            KvType::F32 => 0,
            KvType::F16 => 1,
            KvType::Q4_0 => 2,
            KvType::Q8_0 => 8,
        }
    }

    pub fn from_ggml_id(id: u8) -> Option<KvType> {
        match id {
            0 => Some(KvType::F32),
            1 => Some(KvType::F16),
            2 => Some(KvType::Q4_0),
            8 => Some(KvType::Q8_0),
            _ => None,
        }
    }
}

impl KvBuf {
    /// Type id, element count (values; whole blocks for the quantized types), then the stored
    /// bytes as they are in memory (little-endian, blocks in ggml's layout).
    fn encode(&self, w: &mut StateWriter) {
        w.u8(self.ty().ggml_id());
        match self {
            KvBuf::F16(v) => {
                w.u64(v.len() as u64);
                for x in v {
                    w.bytes(&x.to_bits().to_le_bytes());
                }
            }
            KvBuf::F32(v) => w.f32s(v),
            KvBuf::Q8_0(v) => {
                w.u64((v.len() * QK32) as u64);
                w.bytes(blocks_as_bytes(v));
            }
            KvBuf::Q4_0(v) => {
                w.u64((v.len() * QK32) as u64);
                w.bytes(blocks_as_bytes(v));
            }
        }
    }

    fn decode(r: &mut StateReader<'_>, what: &'static str) -> Result<KvBuf, StateCodecError> {
        let id = r.u8(what)?;
        let ty = KvType::from_ggml_id(id).ok_or(StateCodecError::Invalid {
            what,
            value: u64::from(id),
        })?;
        Ok(match ty {
            KvType::F32 => KvBuf::F32(r.f32s(what)?),
            KvType::F16 => {
                let n = r.u64(what)?;
                let raw = r.elements(n, 2, what)?;
                KvBuf::F16(
                    raw.chunks_exact(2)
                        .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                        .collect(),
                )
            }
            KvType::Q8_0 => KvBuf::Q8_0(decode_blocks(r, what)?),
            KvType::Q4_0 => KvBuf::Q4_0(decode_blocks(r, what)?),
        })
    }

    /// The stored bytes as they are in memory (little-endian, ggml blocks): the device cache's
    /// transfer format.
    pub(crate) fn raw_bytes(&self) -> Vec<u8> {
        match self {
            KvBuf::F16(v) => v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
            KvBuf::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            KvBuf::Q8_0(v) => blocks_as_bytes(v).to_vec(),
            KvBuf::Q4_0(v) => blocks_as_bytes(v).to_vec(),
        }
    }

    /// The inverse of [`KvBuf::raw_bytes`]; bytes that are not whole elements or blocks are an
    /// error.
    pub(crate) fn from_raw_bytes(ty: KvType, raw: &[u8]) -> Result<KvBuf, StateCodecError> {
        let bad = StateCodecError::Invalid {
            what: "device attention rows",
            value: raw.len() as u64,
        };
        Ok(match ty {
            KvType::F32 if raw.len().is_multiple_of(4) => KvBuf::F32(
                raw.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            KvType::F16 if raw.len().is_multiple_of(2) => KvBuf::F16(
                raw.chunks_exact(2)
                    .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                    .collect(),
            ),
            KvType::Q8_0 => KvBuf::Q8_0(blocks_from_bytes(raw).map_err(|_| bad)?.to_vec()),
            KvType::Q4_0 => KvBuf::Q4_0(blocks_from_bytes(raw).map_err(|_| bad)?.to_vec()),
            _ => return Err(bad),
        })
    }

    /// Values held.
    pub(super) fn len(&self) -> usize {
        match self {
            KvBuf::F16(v) => v.len(),
            KvBuf::F32(v) => v.len(),
            KvBuf::Q8_0(v) => v.len() * QK32,
            KvBuf::Q4_0(v) => v.len() * QK32,
        }
    }
}

/// Blocks of a quantized buffer: a value count that is a whole number of blocks, then their bytes.
fn decode_blocks<B: Block>(
    r: &mut StateReader<'_>,
    what: &'static str,
) -> Result<Vec<B>, StateCodecError> {
    let n = r.u64(what)?;
    if n % B::ELEMS as u64 != 0 {
        return Err(StateCodecError::Invalid { what, value: n });
    }
    let raw = r.elements(n / B::ELEMS as u64, B::BYTES as u64, what)?;
    blocks_from_bytes::<B>(raw)
        .map(|b| b.to_vec())
        .map_err(|_| StateCodecError::Invalid { what, value: n })
}

impl KvRows {
    /// Element types of the keys and the values.
    pub fn types(&self) -> (KvType, KvType) {
        (self.k.ty(), self.v.ty())
    }

    pub fn encode(&self, w: &mut StateWriter) {
        w.u64(self.width as u64);
        w.u64(self.len as u64);
        self.k.encode(w);
        self.v.encode(w);
    }

    pub fn decode(r: &mut StateReader<'_>) -> Result<KvRows, StateCodecError> {
        let width = r.count("attention row width")?;
        let len = r.count("attention row count")?;
        let k = KvBuf::decode(r, "attention keys")?;
        let v = KvBuf::decode(r, "attention values")?;
        let expected = width.checked_mul(len).ok_or(StateCodecError::Invalid {
            what: "attention row count",
            value: len as u64,
        })?;
        for (buf, what) in [(&k, "attention keys"), (&v, "attention values")] {
            if buf.len() != expected {
                return Err(StateCodecError::Invalid {
                    what,
                    value: buf.len() as u64,
                });
            }
        }
        Ok(KvRows { k, v, width, len })
    }
}

impl RecurrentSnapshot {
    pub fn encode(&self, w: &mut StateWriter) {
        w.u64(self.n_past as u64);
        w.u64(self.states.len() as u64);
        for s in &self.states {
            w.f32s(&s.conv);
            w.f32s(&s.ssm);
        }
    }

    pub fn decode(r: &mut StateReader<'_>) -> Result<RecurrentSnapshot, StateCodecError> {
        let n_past = r.count("recurrent snapshot position")?;
        let n = r.u64("delta-net layer count")?;
        // Each state takes at least its two lengths.
        if n > r.remaining() as u64 / 16 {
            return Err(StateCodecError::Invalid {
                what: "delta-net layer count",
                value: n,
            });
        }
        let mut states = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let conv = r.f32s("conv window")?;
            let ssm = r.f32s("delta-rule state")?;
            states.push(RecurrentState { conv, ssm });
        }
        Ok(RecurrentSnapshot { n_past, states })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::KvLayer;

    fn rows(k: KvType, v: KvType) -> KvRows {
        rows_of_width(k, v, 3)
    }

    fn rows_of_width(k: KvType, v: KvType, width: usize) -> KvRows {
        let mut kv = KvLayer::new(k, v, 1, width);
        for p in 0..4 {
            let row: Vec<f32> = (0..width)
                .map(|i| (p * width + i) as f32 * 0.37 - 1.0)
                .collect();
            kv.push(&row, &row);
        }
        kv.rows(1, 4)
    }

    #[test]
    fn rows_and_snapshots_round_trip_bit_for_bit() {
        let snapshot = RecurrentSnapshot {
            n_past: 7,
            states: vec![
                RecurrentState {
                    conv: vec![1.5, -0.0, f32::MIN_POSITIVE],
                    ssm: vec![3.25; 5],
                },
                RecurrentState::zeros(2, 1),
            ],
        };
        let mut w = StateWriter::new();
        let (a, b, c) = (
            rows(KvType::F16, KvType::F32),
            rows(KvType::F32, KvType::F16),
            rows_of_width(KvType::Q8_0, KvType::Q4_0, 64),
        );
        assert_eq!(c.types(), (KvType::Q8_0, KvType::Q4_0));
        assert_eq!(c.bytes(), 3 * 2 * (34 + 18));
        a.encode(&mut w);
        b.encode(&mut w);
        c.encode(&mut w);
        snapshot.encode(&mut w);
        let bytes = w.into_bytes();
        let mut r = StateReader::new(&bytes);
        assert_eq!(KvRows::decode(&mut r).unwrap(), a);
        assert_eq!(KvRows::decode(&mut r).unwrap(), b);
        assert_eq!(KvRows::decode(&mut r).unwrap(), c);
        assert_eq!(RecurrentSnapshot::decode(&mut r).unwrap(), snapshot);
        assert_eq!(r.remaining(), 0);
    }

    #[test]
    fn every_truncation_is_an_error() {
        let mut w = StateWriter::new();
        rows(KvType::F16, KvType::F16).encode(&mut w);
        RecurrentSnapshot {
            n_past: 2,
            states: vec![RecurrentState::zeros(4, 4)],
        }
        .encode(&mut w);
        let bytes = w.into_bytes();
        for cut in 0..bytes.len() {
            let mut r = StateReader::new(&bytes[..cut]);
            let result = KvRows::decode(&mut r)
                .map(|_| ())
                .and_then(|_| RecurrentSnapshot::decode(&mut r).map(|_| ()));
            assert!(result.is_err(), "cut at {cut} decoded");
        }
    }

    #[test]
    fn lengths_that_disagree_are_refused() {
        let mut w = StateWriter::new();
        w.u64(3); // width
        w.u64(u64::MAX); // rows
        let bytes = w.into_bytes();
        assert!(KvRows::decode(&mut StateReader::new(&bytes)).is_err());

        let mut w = StateWriter::new();
        rows(KvType::F32, KvType::F32).encode(&mut w);
        let mut bytes = w.into_bytes();
        // Claim one more row than the buffers hold.
        bytes[8] += 1;
        assert!(matches!(
            KvRows::decode(&mut StateReader::new(&bytes)),
            Err(StateCodecError::Invalid { .. })
        ));
    }
}
