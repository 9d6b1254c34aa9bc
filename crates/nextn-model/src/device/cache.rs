//! A sequence's caches on the device: attention K/V per layer and the delta-net states, with the
//! rows a verify pass keeps until commit. Everything here mirrors `crate::cache`; rows and
//! snapshots leave and enter through the same host types, so the prefix cache and slot files
//! work unchanged.

use std::sync::Arc;

use nextn_gpu::kv::{DeviceKv, KvElem};
use nextn_gpu::Gpu;

use crate::cache::{KvBuf, KvRows, KvType, RecurrentState};
use crate::ModelError;

use super::gpu_err;

pub(crate) fn kv_elem(t: KvType) -> Result<KvElem, ModelError> {
    match t {
        KvType::F32 => Ok(KvElem::F32),
        KvType::F16 => Ok(KvElem::F16),
        KvType::Q8_0 => Ok(KvElem::Q8_0),
        other => Err(ModelError::BadValue {
            key: "cache-type".into(),
            why: format!(
                "the GPU keeps K/V as f32, f16 or q8_0, not {}",
                other.name()
            ),
        }),
    }
}

/// One attention layer's K/V for one sequence, on the device.
pub struct DeviceKvCache {
    pub(crate) gpu: Arc<Gpu>,
    pub(crate) kv: DeviceKv,
    pub(crate) k_type: KvType,
    pub(crate) v_type: KvType,
    pub(crate) width: usize,
}

impl std::fmt::Debug for DeviceKvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceKvCache")
            .field("len", &self.kv.len())
            .field("width", &self.width)
            .finish()
    }
}

impl DeviceKvCache {
    pub(crate) fn new(
        gpu: &Arc<Gpu>,
        k_type: KvType,
        v_type: KvType,
        n_heads: usize,
        head_dim: usize,
        capacity: usize,
    ) -> Result<Self, ModelError> {
        let kv = DeviceKv::new(
            gpu,
            kv_elem(k_type)?,
            kv_elem(v_type)?,
            n_heads,
            head_dim,
            capacity,
        )
        .map_err(gpu_err)?;
        Ok(DeviceKvCache {
            gpu: gpu.clone(),
            kv,
            k_type,
            v_type,
            width: n_heads * head_dim,
        })
    }

    pub fn len(&self) -> usize {
        self.kv.len()
    }

    pub fn is_empty(&self) -> bool {
        self.kv.len() == 0
    }

    pub fn truncate(&mut self, pos: usize) {
        self.kv.truncate(pos);
    }

    pub fn bytes(&self) -> usize {
        self.kv.bytes() as usize
    }

    /// Positions `start..end` as host rows in the stored element types.
    pub fn rows(&self, start: usize, end: usize) -> Result<KvRows, ModelError> {
        let end = end.min(self.len());
        let start = start.min(end);
        let (k, v) = self.kv.read_rows(&self.gpu, start, end).map_err(gpu_err)?;
        let conv = |e: crate::StateCodecError| ModelError::BadValue {
            key: "device KV cache".into(),
            why: e.to_string(),
        };
        Ok(KvRows {
            k: KvBuf::from_raw_bytes(self.k_type, &k).map_err(conv)?,
            v: KvBuf::from_raw_bytes(self.v_type, &v).map_err(conv)?,
            width: self.width,
            len: end - start,
        })
    }

    pub fn append_rows(&mut self, rows: &KvRows) -> Result<(), ModelError> {
        if rows.width != self.width || rows.k.ty() != self.k_type || rows.v.ty() != self.v_type {
            return Err(ModelError::SnapshotKvType);
        }
        self.kv
            .append_rows(
                &self.gpu,
                &rows.k.raw_bytes(),
                &rows.v.raw_bytes(),
                rows.len,
            )
            .map_err(gpu_err)
    }

    /// A copy on the device (the prefix cache clones a head's state).
    pub fn try_clone(&self) -> Result<Self, ModelError> {
        let mut other = DeviceKvCache::new(
            &self.gpu,
            self.k_type,
            self.v_type,
            self.kv.n_kv_heads(),
            self.kv.head_dim(),
            self.kv.capacity(),
        )?;
        if !self.is_empty() {
            let rows = self.rows(0, self.len())?;
            other.append_rows(&rows)?;
        }
        Ok(other)
    }
}

impl Drop for DeviceKvCache {
    /// Deferred work that still uses the cache runs before its memory goes.
    fn drop(&mut self) {
        let _ = self.gpu.flush();
    }
}

/// Device bytes of one verify row's kept inputs: raw projections ([q|k|v], β, α) and the
/// replay's discarded outputs.
/// Verify rows a delta-net cache has room for from the start: the default draft depth's
/// (3 drafts and the row before them), so a speculative request's passes bind the same buffers
/// from its first step.
const VERIFY_ROWS_AT_START: usize = 4;

fn verify_row_bytes(conv_dim: usize, v_heads: usize, inner: usize) -> usize {
    (conv_dim + 2 * v_heads + inner) * 4
}

fn reserve_rows(
    gpu: &Gpu,
    n: usize,
    conv_dim: usize,
    v_heads: usize,
    inner: usize,
) -> Result<nextn_gpu::Reservation, ModelError> {
    gpu.reserve(
        &format!("a delta-net layer's {n} verify rows"),
        (n * verify_row_bytes(conv_dim, v_heads, inner)) as u64,
    )
    .map_err(gpu_err)
}

/// One delta-net layer's state for one sequence, on the device: two copies of the state and of
/// the conv window, one committed and one that a pass writes the state (a verify pass) and the
/// window (every pass) after its rows into (each pair in one buffer, so the sequence's bind
/// groups do not change when the other copy becomes the committed one), and the verify rows'
/// raw projections until commit.
pub struct DeviceDeltaNetCache {
    pub(crate) gpu: Arc<Gpu>,
    pub(crate) states: wgpu::Buffer,
    pub(crate) windows: wgpu::Buffer,
    /// Which copy (0 or 1) of the state, and of the window, is the committed one.
    pub(crate) state_at: usize,
    pub(crate) window_at: usize,
    /// Verify rows kept for commit: raw projections, and a discard buffer for the outputs of a
    /// replay.
    pub(crate) keep: wgpu::Buffer,
    pub(crate) replay_out: wgpu::Buffer,
    /// Rows the pending buffers have room for.
    pub(crate) capacity: usize,
    /// The device memory of the states and the windows; and of the verify rows.
    _fixed: nextn_gpu::Reservation,
    _rows: nextn_gpu::Reservation,
    pub(crate) pending: usize,
    pub(crate) conv_len: usize,
    pub(crate) ssm_len: usize,
    pub(crate) conv_dim: usize,
    pub(crate) v_heads: usize,
    pub(crate) inner: usize,
}

impl std::fmt::Debug for DeviceDeltaNetCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceDeltaNetCache")
            .field("pending", &self.pending)
            .finish()
    }
}

impl DeviceDeltaNetCache {
    pub(crate) fn new(
        gpu: &Arc<Gpu>,
        conv_len: usize,
        ssm_len: usize,
        conv_dim: usize,
        v_heads: usize,
        inner: usize,
    ) -> Result<Self, ModelError> {
        let b = |label: &str, n: usize| gpu.buffer(label, (n * 4) as u64).map_err(gpu_err);
        let capacity = VERIFY_ROWS_AT_START;
        let fixed = gpu
            .reserve(
                "a delta-net layer's recurrent state",
                ((2 * ssm_len + 2 * conv_len) * 4) as u64,
            )
            .map_err(gpu_err)?;
        let rows = reserve_rows(gpu, capacity, conv_dim, v_heads, inner)?;
        Ok(DeviceDeltaNetCache {
            _fixed: fixed,
            _rows: rows,
            gpu: gpu.clone(),
            states: b("ssm-states", 2 * ssm_len)?,
            windows: b("conv-windows", 2 * conv_len.max(1))?,
            state_at: 0,
            window_at: 0,
            keep: b("verify-raw", capacity * (conv_dim + 2 * v_heads))?,
            replay_out: b("replay-out", capacity * inner)?,
            capacity,
            pending: 0,
            conv_len,
            ssm_len,
            conv_dim,
            v_heads,
            inner,
        })
    }

    /// Element offsets of the committed state and of the other copy.
    pub(crate) fn state_offsets(&self) -> (u32, u32) {
        let sl = self.ssm_len as u32;
        let at = self.state_at as u32;
        (at * sl, (1 - at) * sl)
    }

    /// Element offsets of the committed conv window and of the other copy.
    pub(crate) fn window_offsets(&self) -> (u32, u32) {
        let wl = self.conv_len as u32;
        let at = self.window_at as u32;
        (at * wl, (1 - at) * wl)
    }

    /// Room for `n` verify rows, grown to a power of two so that a request's deeper drafts
    /// (new buffers, so new bind groups) come once, not at each new depth.
    pub(crate) fn reserve(&mut self, n: usize) -> Result<(), ModelError> {
        if n <= self.capacity {
            return Ok(());
        }
        let n = n.next_power_of_two();
        let g = &self.gpu;
        let b = |label: &str, m: usize| g.buffer(label, (m * 4) as u64).map_err(gpu_err);
        // The old rows' memory stays reserved until the new rows' is: both exist for a moment.
        self._rows = reserve_rows(g, n, self.conv_dim, self.v_heads, self.inner)?;
        self.keep = b("verify-raw", n * (self.conv_dim + 2 * self.v_heads))?;
        self.replay_out = b("replay-out", n * self.inner)?;
        self.capacity = n;
        Ok(())
    }

    pub fn bytes(&self) -> usize {
        (2 * self.ssm_len + 2 * self.conv_len) * 4
            + verify_row_bytes(self.conv_dim, self.v_heads, self.inner) * self.capacity
    }

    /// The committed state, read back (in one submission, with one wait).
    pub fn snapshot(&self) -> Result<RecurrentState, ModelError> {
        let mut rec = nextn_gpu::Recorder::new(&self.gpu);
        let (s0, w0) = (
            self.state_offsets().0 as u64,
            self.window_offsets().0 as u64,
        );
        let conv = rec.read_back(&self.windows, 4 * w0, (self.conv_len * 4) as u64);
        let ssm = rec.read_back(&self.states, 4 * s0, (self.ssm_len * 4) as u64);
        let mut back = rec.submit_read(nextn_gpu::Timing::Off).map_err(gpu_err)?;
        Ok(RecurrentState {
            conv: back.f32s(conv),
            ssm: back.f32s(ssm),
        })
    }

    pub fn set_state(&mut self, s: &RecurrentState) -> Result<(), ModelError> {
        if s.conv.len() != self.conv_len || s.ssm.len() != self.ssm_len {
            return Err(ModelError::SnapshotMismatch {
                what: "recurrent state values",
                expected: self.conv_len + self.ssm_len,
                found: s.conv.len() + s.ssm.len(),
            });
        }
        let (s0, w0) = (
            self.state_offsets().0 as u64,
            self.window_offsets().0 as u64,
        );
        self.gpu
            .write_f32(&self.windows, w0, &s.conv)
            .map_err(gpu_err)?;
        self.gpu
            .write_f32(&self.states, s0, &s.ssm)
            .map_err(gpu_err)?;
        self.pending = 0;
        Ok(())
    }

    pub fn try_clone(&self) -> Result<Self, ModelError> {
        let mut other = DeviceDeltaNetCache::new(
            &self.gpu,
            self.conv_len,
            self.ssm_len,
            self.conv_dim,
            self.v_heads,
            self.inner,
        )?;
        let mut rec = nextn_gpu::Recorder::new(&self.gpu);
        let (s0, w0) = (
            self.state_offsets().0 as u64,
            self.window_offsets().0 as u64,
        );
        rec.copy(
            &self.states,
            4 * s0,
            &other.states,
            0,
            (self.ssm_len * 4) as u64,
        );
        rec.copy(
            &self.windows,
            4 * w0,
            &other.windows,
            0,
            (self.conv_len * 4) as u64,
        );
        rec.submit(false).map_err(gpu_err)?;
        other.pending = 0;
        Ok(other)
    }
}

impl Drop for DeviceDeltaNetCache {
    /// The device memory goes at once (bind groups made for these buffers may outlive them for
    /// a while), after any deferred work that still uses it.
    fn drop(&mut self) {
        let _ = self.gpu.flush();
        for b in [&self.states, &self.windows, &self.keep, &self.replay_out] {
            b.destroy();
        }
    }
}

// The prefix cache and kept slots clone a head's state between steps. A device copy can fail
// only when the device itself fails (the sizes are those of a cache that exists).
impl Clone for DeviceKvCache {
    fn clone(&self) -> Self {
        self.try_clone()
            .unwrap_or_else(|e| panic!("copying a KV cache on the device failed: {e}"))
    }
}

impl Clone for DeviceDeltaNetCache {
    fn clone(&self) -> Self {
        self.try_clone()
            .unwrap_or_else(|e| panic!("copying a recurrent state on the device failed: {e}"))
    }
}
