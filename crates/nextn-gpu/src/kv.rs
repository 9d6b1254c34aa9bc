//! One attention layer's KV cache on the device, for one sequence.
//!
//! Each kv head's history is one contiguous run of positions in the buffer (as the CPU cache
//! keeps it), so attention streams a head's keys and values front to back:
//!
//! - `F32`: `[head][capacity][head_dim]` f32;
//! - `F16`: `[head][capacity][head_dim]` IEEE halves, two to a u32 word;
//! - `Q8_0`: the codes `[head][capacity][head_dim]` as signed bytes, four to a word, then the
//!   scales `[head][capacity][ceil(head_dim / 64)]` as halves, one per 32 values, two to a word
//!   (a position's last word half empty when `head_dim / 32` is odd).
//!   Codes and scales apart keep every load a whole word; ggml's 34-byte blocks would straddle
//!   words.
//!
//! The host's length is the only record of how many positions are valid: a store sets it, a
//! rollback only lowers it, and attention reads no position at or past it.
//!
//! Host transfers use the CPU cache's row format (`KvRows`): position by position, every kv
//! head's `head_dim` values of a position together, in the element type's ggml encoding.

use crate::{Gpu, GpuError};

/// Element type of cached keys or values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvElem {
    F32,
    F16,
    Q8_0,
}

/// Values per Q8_0 block.
pub const Q8_0_BLOCK: usize = 32;
/// Bytes of one ggml Q8_0 block: an f16 scale and 32 signed codes.
const Q8_0_BLOCK_BYTES: usize = 34;

impl KvElem {
    /// The id the kernels take for this type.
    pub(crate) fn code(self) -> u32 {
        match self {
            KvElem::F32 => 0,
            KvElem::F16 => 1,
            KvElem::Q8_0 => 2,
        }
    }

    /// Bytes of `head_dim` values in ggml's encoding (the host row format).
    pub fn ggml_bytes(self, head_dim: usize) -> usize {
        match self {
            KvElem::F32 => 4 * head_dim,
            KvElem::F16 => 2 * head_dim,
            KvElem::Q8_0 => head_dim / Q8_0_BLOCK * Q8_0_BLOCK_BYTES,
        }
    }
}

/// Words of Q8_0 scales per position of one head: two halves to a word.
fn q8_scale_words(head_dim: usize) -> usize {
    (head_dim / Q8_0_BLOCK).div_ceil(2)
}

/// One buffer of cached keys or values.
struct Side {
    buf: wgpu::Buffer,
    elem: KvElem,
}

/// The largest head the attention kernels take.
pub const MAX_HEAD_DIM: usize = 512;

/// Keys and values of one attention layer for one sequence, positions `0..len()` of a fixed
/// capacity.
pub struct DeviceKv {
    k: Side,
    v: Side,
    n_kv_heads: usize,
    head_dim: usize,
    capacity: usize,
    len: usize,
    _reservation: crate::Reservation,
}

impl DeviceKv {
    /// A cache of `capacity` positions of `n_kv_heads` heads of `head_dim` values, allocated now.
    /// `head_dim` must be a multiple of 32 (the Q8_0 block, and what the kernels tile by) and at
    /// most [`MAX_HEAD_DIM`].
    pub fn new(
        gpu: &Gpu,
        k: KvElem,
        v: KvElem,
        n_kv_heads: usize,
        head_dim: usize,
        capacity: usize,
    ) -> Result<DeviceKv, GpuError> {
        if head_dim == 0 || !head_dim.is_multiple_of(Q8_0_BLOCK) || head_dim > MAX_HEAD_DIM {
            return Err(GpuError::BadTensor {
                tensor: "attention KV cache".into(),
                why: format!(
                    "head_dim {head_dim} is not a multiple of {Q8_0_BLOCK} up to {MAX_HEAD_DIM}"
                ),
            });
        }
        if n_kv_heads == 0 || capacity == 0 {
            return Err(GpuError::BadTensor {
                tensor: "attention KV cache".into(),
                why: format!("{n_kv_heads} kv heads, {capacity} positions"),
            });
        }
        // One binding holds a whole side: a context past the limit needs the positions split
        // over several buffers (and the kernels to take a buffer per part), which is the next
        // step when longer contexts are wanted.
        let side_bytes = |elem: KvElem, what: &str| -> Result<u64, GpuError> {
            let bytes = device_row_bytes(elem, head_dim)
                .checked_mul(n_kv_heads)
                .and_then(|b| b.checked_mul(capacity))
                .map(|b| (b as u64).div_ceil(16) * 16);
            let limit = gpu.max_binding_bytes();
            match bytes {
                Some(b) if b <= limit => Ok(b),
                _ => Err(GpuError::BufferTooLarge {
                    what: format!(
                        "the attention {what} at a context of {capacity} positions \
                         ({n_kv_heads} kv heads of {head_dim}, {elem:?})"
                    ),
                    bytes: bytes.unwrap_or(u64::MAX),
                    limit,
                }),
            }
        };
        let (k_bytes, v_bytes) = (side_bytes(k, "keys")?, side_bytes(v, "values")?);
        let reservation = gpu.reserve(
            &format!("an attention layer's KV cache of {capacity} positions"),
            k_bytes + v_bytes,
        )?;
        Ok(DeviceKv {
            k: Side {
                buf: gpu.buffer("keys", k_bytes)?,
                elem: k,
            },
            v: Side {
                buf: gpu.buffer("values", v_bytes)?,
                elem: v,
            },
            n_kv_heads,
            head_dim,
            capacity,
            len: 0,
            _reservation: reservation,
        })
    }

    /// Valid positions.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn n_kv_heads(&self) -> usize {
        self.n_kv_heads
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    pub fn k_elem(&self) -> KvElem {
        self.k.elem
    }

    pub fn v_elem(&self) -> KvElem {
        self.v.elem
    }

    /// Device memory allocated for the whole capacity, keys and values.
    pub fn bytes(&self) -> u64 {
        self.k.buf.size() + self.v.buf.size()
    }

    /// Drop every position `>= pos` (the data stays; only the length moves).
    pub fn truncate(&mut self, pos: usize) {
        self.len = self.len.min(pos);
    }

    pub(crate) fn k_buffer(&self) -> &wgpu::Buffer {
        &self.k.buf
    }

    pub(crate) fn v_buffer(&self) -> &wgpu::Buffer {
        &self.v.buf
    }

    /// Record that positions `0..len` hold data (kernels just wrote up to `len`).
    pub(crate) fn set_len(&mut self, len: usize) {
        self.len = len;
    }

    /// The word where Q8_0 scales start in a side's buffer (after every head's codes).
    pub(crate) fn q8_scales_word(&self) -> usize {
        self.n_kv_heads * self.capacity * self.head_dim / 4
    }

    /// Keys and values of positions `start..end` in the CPU cache's row format: position by
    /// position, each kv head's `head_dim` values in turn, as f32 (little-endian), f16 (IEEE
    /// half bits, little-endian) or ggml Q8_0 blocks (f16 scale, 32 signed codes) per 32 values
    /// of one head.
    pub fn read_rows(
        &self,
        gpu: &Gpu,
        start: usize,
        end: usize,
    ) -> Result<(Vec<u8>, Vec<u8>), GpuError> {
        if start > end || end > self.len {
            return Err(GpuError::BadTensor {
                tensor: "attention KV cache".into(),
                why: format!(
                    "rows {start}..{end} asked of a cache of {} positions",
                    self.len
                ),
            });
        }
        let n = end - start;
        if n == 0 {
            return Ok((Vec::new(), Vec::new()));
        }
        // Every head's run of positions is read back in one submission, with one wait.
        let k_runs = self.runs(self.k.elem, start, n);
        let v_runs = self.runs(self.v.elem, start, n);
        let mut rec = crate::Recorder::new(gpu);
        let slots: Vec<crate::ReadSlot> = k_runs
            .iter()
            .map(|r| (&self.k.buf, r))
            .chain(v_runs.iter().map(|r| (&self.v.buf, r)))
            .map(|(buf, r)| rec.read_back(buf, r.offset, r.bytes))
            .collect();
        let mut back = rec.submit_read(crate::Timing::Off)?;
        let bytes: Vec<u8> = slots.into_iter().flat_map(|s| back.take(s)).collect();
        let runs: Vec<&Run> = k_runs.iter().chain(&v_runs).collect();
        let n_k_runs = k_runs.len();
        let k_total: u64 = runs[..n_k_runs].iter().map(|r| r.bytes).sum();
        let (k_dev, v_dev) = bytes.split_at(k_total as usize);
        Ok((
            self.device_to_rows(self.k.elem, k_dev, n),
            self.device_to_rows(self.v.elem, v_dev, n),
        ))
    }

    /// Append `n` positions given in [`DeviceKv::read_rows`]'s format at the current length.
    pub fn append_rows(
        &mut self,
        gpu: &Gpu,
        k_bytes: &[u8],
        v_bytes: &[u8],
        n: usize,
    ) -> Result<(), GpuError> {
        for (what, side, bytes) in [("keys", &self.k, k_bytes), ("values", &self.v, v_bytes)] {
            let want = n * self.n_kv_heads * side.elem.ggml_bytes(self.head_dim);
            if bytes.len() != want {
                return Err(GpuError::BadTensor {
                    tensor: format!("attention {what}"),
                    why: format!(
                        "{} bytes given for {n} positions of {:?}, which take {want}",
                        bytes.len(),
                        side.elem
                    ),
                });
            }
        }
        if self.len + n > self.capacity {
            return Err(GpuError::BadTensor {
                tensor: "attention KV cache".into(),
                why: format!(
                    "{n} positions appended to {} of a capacity of {}",
                    self.len, self.capacity
                ),
            });
        }
        for (side, bytes) in [(&self.k, k_bytes), (&self.v, v_bytes)] {
            let dev = self.rows_to_device(side.elem, bytes, n);
            let mut at = 0usize;
            for r in self.runs(side.elem, self.len, n) {
                gpu.write(&side.buf, r.offset, &dev[at..at + r.bytes as usize])?;
                at += r.bytes as usize;
            }
        }
        self.len += n;
        Ok(())
    }

    /// The device byte ranges holding positions `start..start + n` of one side: per head, the
    /// values (codes for Q8_0), then for Q8_0 per head the scales.
    fn runs(&self, elem: KvElem, start: usize, n: usize) -> Vec<Run> {
        let (heads, cap, hd) = (self.n_kv_heads, self.capacity, self.head_dim);
        let value_bytes = match elem {
            KvElem::F32 => 4 * hd,
            KvElem::F16 => 2 * hd,
            KvElem::Q8_0 => hd,
        };
        let mut runs: Vec<Run> = (0..heads)
            .map(|g| Run {
                offset: ((g * cap + start) * value_bytes) as u64,
                bytes: (n * value_bytes) as u64,
            })
            .collect();
        if elem == KvElem::Q8_0 {
            let scale_bytes = 4 * q8_scale_words(hd);
            let base = 4 * self.q8_scales_word();
            runs.extend((0..heads).map(|g| Run {
                offset: (base + (g * cap + start) * scale_bytes) as u64,
                bytes: (n * scale_bytes) as u64,
            }));
        }
        runs
    }

    /// Device runs (as [`DeviceKv::runs`] orders them) of `n` positions to host rows.
    fn device_to_rows(&self, elem: KvElem, dev: &[u8], n: usize) -> Vec<u8> {
        let (heads, hd) = (self.n_kv_heads, self.head_dim);
        let row = elem.ggml_bytes(hd);
        let mut out = vec![0u8; n * heads * row];
        match elem {
            KvElem::F32 | KvElem::F16 => {
                for g in 0..heads {
                    for p in 0..n {
                        let src = (g * n + p) * row;
                        let dst = (p * heads + g) * row;
                        out[dst..dst + row].copy_from_slice(&dev[src..src + row]);
                    }
                }
            }
            KvElem::Q8_0 => {
                let scale_bytes = 4 * q8_scale_words(hd);
                let scales = &dev[heads * n * hd..];
                for g in 0..heads {
                    for p in 0..n {
                        let codes = &dev[(g * n + p) * hd..][..hd];
                        let d = &scales[(g * n + p) * scale_bytes..][..scale_bytes];
                        let dst = &mut out[(p * heads + g) * row..][..row];
                        for (b, block) in dst.chunks_exact_mut(Q8_0_BLOCK_BYTES).enumerate() {
                            block[..2].copy_from_slice(&d[2 * b..2 * b + 2]);
                            block[2..].copy_from_slice(&codes[b * Q8_0_BLOCK..][..Q8_0_BLOCK]);
                        }
                    }
                }
            }
        }
        out
    }

    /// Host rows of `n` positions to device runs, the inverse of [`DeviceKv::device_to_rows`].
    fn rows_to_device(&self, elem: KvElem, rows: &[u8], n: usize) -> Vec<u8> {
        let (heads, hd) = (self.n_kv_heads, self.head_dim);
        let row = elem.ggml_bytes(hd);
        match elem {
            KvElem::F32 | KvElem::F16 => {
                let mut dev = vec![0u8; n * heads * row];
                for g in 0..heads {
                    for p in 0..n {
                        let src = (p * heads + g) * row;
                        let dst = (g * n + p) * row;
                        dev[dst..dst + row].copy_from_slice(&rows[src..src + row]);
                    }
                }
                dev
            }
            KvElem::Q8_0 => {
                let scale_bytes = 4 * q8_scale_words(hd);
                let mut dev = vec![0u8; heads * n * (hd + scale_bytes)];
                let (codes, scales) = dev.split_at_mut(heads * n * hd);
                for g in 0..heads {
                    for p in 0..n {
                        let src = &rows[(p * heads + g) * row..][..row];
                        let c = &mut codes[(g * n + p) * hd..][..hd];
                        let d = &mut scales[(g * n + p) * scale_bytes..][..scale_bytes];
                        for (b, block) in src.chunks_exact(Q8_0_BLOCK_BYTES).enumerate() {
                            d[2 * b..2 * b + 2].copy_from_slice(&block[..2]);
                            c[b * Q8_0_BLOCK..][..Q8_0_BLOCK].copy_from_slice(&block[2..]);
                        }
                    }
                }
                dev
            }
        }
    }
}

impl Drop for DeviceKv {
    /// The device memory goes at once (bind groups made for these buffers may outlive them for
    /// a while). Work deferred with it must have been submitted ([`Gpu::flush`]).
    fn drop(&mut self) {
        self.k.buf.destroy();
        self.v.buf.destroy();
    }
}

/// Bytes one position of one head takes on the device.
fn device_row_bytes(elem: KvElem, head_dim: usize) -> usize {
    match elem {
        KvElem::F32 => 4 * head_dim,
        KvElem::F16 => 2 * head_dim,
        KvElem::Q8_0 => head_dim + 4 * q8_scale_words(head_dim),
    }
}

/// A byte range of a cache buffer.
struct Run {
    offset: u64,
    bytes: u64,
}
