//! Per-sequence caches: the attention KV cache of each full-attention layer and the recurrent
//! state (causal-conv window + delta-net state) of each gated-delta-net layer (docs/MODEL.md,
//! "Caches" and "Speculative verify rollback").

use half::f16;

use crate::ModelError;

/// Element type of the attention KV cache (`-ctk` / `-ctv`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvType {
    F16,
    F32,
}

impl KvType {
    pub fn parse(s: &str) -> Option<KvType> {
        match s.to_ascii_lowercase().as_str() {
            "f16" => Some(KvType::F16),
            "f32" => Some(KvType::F32),
            _ => None,
        }
    }

    pub fn bytes(self) -> usize {
        match self {
            KvType::F16 => 2,
            KvType::F32 => 4,
        }
    }
}

/// One tensor of cached vectors, `width` values per position.
#[derive(Clone, Debug)]
enum KvBuf {
    F16(Vec<f16>),
    F32(Vec<f32>),
}

impl KvBuf {
    fn new(ty: KvType) -> Self {
        match ty {
            KvType::F16 => KvBuf::F16(Vec::new()),
            KvType::F32 => KvBuf::F32(Vec::new()),
        }
    }

    fn push(&mut self, row: &[f32]) {
        match self {
            KvBuf::F16(v) => v.extend(row.iter().map(|&x| f16::from_f32(x))),
            KvBuf::F32(v) => v.extend_from_slice(row),
        }
    }

    fn truncate(&mut self, len: usize) {
        match self {
            KvBuf::F16(v) => v.truncate(len),
            KvBuf::F32(v) => v.truncate(len),
        }
    }

    fn read(&self, start: usize, out: &mut [f32]) {
        match self {
            KvBuf::F16(v) => {
                let n = out.len();
                for (o, x) in out.iter_mut().zip(&v[start..start + n]) {
                    *o = x.to_f32();
                }
            }
            KvBuf::F32(v) => out.copy_from_slice(&v[start..start + out.len()]),
        }
    }
}

/// Keys and values of one attention layer for positions `0..len`.
#[derive(Clone, Debug)]
pub struct KvLayer {
    k: KvBuf,
    v: KvBuf,
    /// Values per position: `n_head_kv · head_dim`.
    width: usize,
    len: usize,
}

impl KvLayer {
    pub fn new(k_type: KvType, v_type: KvType, width: usize) -> Self {
        KvLayer {
            k: KvBuf::new(k_type),
            v: KvBuf::new(v_type),
            width,
            len: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn push(&mut self, k: &[f32], v: &[f32]) {
        self.k.push(&k[..self.width]);
        self.v.push(&v[..self.width]);
        self.len += 1;
    }

    /// Drop every position `>= pos`.
    pub fn truncate(&mut self, pos: usize) {
        if pos < self.len {
            self.k.truncate(pos * self.width);
            self.v.truncate(pos * self.width);
            self.len = pos;
        }
    }

    /// Copy `len` positions of the key (or value) vectors of one kv head, starting at position 0,
    /// into `out` as `[pos][head_dim]`.
    pub fn read_head(
        &self,
        values: bool,
        head: usize,
        head_dim: usize,
        len: usize,
        out: &mut Vec<f32>,
    ) {
        out.resize(len * head_dim, 0.0);
        let buf = if values { &self.v } else { &self.k };
        for p in 0..len {
            buf.read(
                p * self.width + head * head_dim,
                &mut out[p * head_dim..(p + 1) * head_dim],
            );
        }
    }
}

/// The recurrent state of one gated-delta-net layer after some position.
#[derive(Clone, Debug, PartialEq)]
pub struct RecurrentState {
    /// The last `Kc − 1` raw (pre-conv) inputs, oldest first: `(Kc−1) × conv_dim`.
    pub conv: Vec<f32>,
    /// Per v head m, `S_m[i][j]` (i = key dim, j = value dim) row-major: `Hv × dk × dv`.
    pub ssm: Vec<f32>,
}

impl RecurrentState {
    pub fn zeros(conv_len: usize, ssm_len: usize) -> Self {
        RecurrentState {
            conv: vec![0.0; conv_len],
            ssm: vec![0.0; ssm_len],
        }
    }
}

/// Per-row inputs of the delta-rule recurrence from a verify batch, kept until commit so that a
/// partial acceptance replays only the kept rows.
#[derive(Clone, Debug)]
pub struct RowInputs {
    pub n: usize,
    /// Raw (pre-conv) projections `n × conv_dim`: they become the conv window.
    pub raw: Vec<f32>,
    /// Conv + SiLU outputs with q and k L2-normalised, `n × conv_dim`.
    pub conv: Vec<f32>,
    /// Per row and v head.
    pub beta: Vec<f32>,
    pub decay: Vec<f32>,
}

impl RowInputs {
    pub fn new(n: usize, conv_dim: usize, v_heads: usize) -> Self {
        RowInputs {
            n,
            raw: vec![0.0; n * conv_dim],
            conv: vec![0.0; n * conv_dim],
            beta: vec![0.0; n * v_heads],
            decay: vec![0.0; n * v_heads],
        }
    }
}

/// A delta-net layer's cache: the committed state, a spare state buffer that a verify batch writes
/// its final state into, and the verify rows awaiting commit.
#[derive(Clone, Debug)]
pub struct DeltaNetCache {
    pub state: RecurrentState,
    pub spare: Vec<f32>,
    pub pending: Option<RowInputs>,
}

/// What one trunk layer caches for a sequence.
#[derive(Clone, Debug)]
pub enum LayerCache {
    Attention(KvLayer),
    DeltaNet(DeltaNetCache),
}

/// Everything the target model remembers about one sequence.
#[derive(Clone, Debug)]
pub struct SequenceState {
    pub layers: Vec<LayerCache>,
    /// Number of committed positions.
    pub n_past: usize,
    /// Context length this sequence may grow to.
    pub n_ctx: usize,
    /// Rows of a verify batch at the end of `n_past` that are not committed yet.
    pub pending_rows: usize,
}

impl SequenceState {
    /// Positions still free in the context.
    pub fn remaining(&self) -> usize {
        self.n_ctx.saturating_sub(self.n_past)
    }

    pub fn check_room(&self, n: usize) -> Result<(), ModelError> {
        if self.n_past + n > self.n_ctx {
            return Err(ModelError::ContextFull {
                n_past: self.n_past,
                n_new: n,
                n_ctx: self.n_ctx,
            });
        }
        Ok(())
    }

    /// Drop positions `>= pos` from every attention layer. Recurrent states cannot be truncated
    /// on their own: [`crate::Model::commit`] pairs this with the delta-net commit of the kept rows.
    pub fn truncate_kv(&mut self, pos: usize) {
        for l in &mut self.layers {
            if let LayerCache::Attention(kv) = l {
                kv.truncate(pos);
            }
        }
    }

    /// Bytes held by the caches now.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerCache::Attention(kv) => {
                    let kb = match &kv.k {
                        KvBuf::F16(v) => v.len() * 2,
                        KvBuf::F32(v) => v.len() * 4,
                    };
                    let vb = match &kv.v {
                        KvBuf::F16(v) => v.len() * 2,
                        KvBuf::F32(v) => v.len() * 4,
                    };
                    kb + vb
                }
                LayerCache::DeltaNet(c) => {
                    (c.state.conv.len() + c.state.ssm.len() + c.spare.len()) * 4
                }
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_truncate_and_read() {
        let mut kv = KvLayer::new(KvType::F32, KvType::F16, 4);
        for p in 0..5 {
            let row: Vec<f32> = (0..4).map(|i| (p * 10 + i) as f32).collect();
            kv.push(&row, &row);
        }
        kv.truncate(3);
        assert_eq!(kv.len(), 3);
        let mut out = Vec::new();
        kv.read_head(false, 1, 2, 3, &mut out);
        assert_eq!(out, vec![2.0, 3.0, 12.0, 13.0, 22.0, 23.0]);
        kv.read_head(true, 0, 2, 3, &mut out);
        assert_eq!(out, vec![0.0, 1.0, 10.0, 11.0, 20.0, 21.0]);
    }
}
