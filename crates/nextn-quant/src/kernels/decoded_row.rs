//! Per-thread scratch that holds one weight row decoded for the SIMD dot products, so
//! each weight block is unpacked once however many activation rows it meets.

use crate::GgmlType;

/// Buffers for one decoded weight row; which ones a type fills depends on its family and
/// on the instruction set (see the decoders).
pub(crate) struct DecodedRow {
    /// One byte per weight: int8 values (or unsigned, for types whose kernel subtracts an
    /// offset through the activation sums).
    pub q: Vec<u8>,
    /// |q| for types decoded signed on x86, so each activation row skips the `abs`.
    pub qabs: Vec<u8>,
    /// Per-block weight scale.
    pub d: Vec<f32>,
    /// Per-block minimum (Q4_1, Q5_1) or min scale (Q2_K, Q4_K, Q5_K).
    pub m: Vec<f32>,
    /// Sub-block scales as the instruction set wants them (at most one i16 per 2 weights).
    pub sc: Vec<i16>,
    /// Per-16-weight minimums / offsets, multiplied with the activation's 16-sums.
    pub mins: Vec<i16>,
    /// F16 / BF16 weights widened to f32.
    pub f: Vec<f32>,
}

impl DecodedRow {
    /// Buffers large enough for rows of `cols` weights of type `ty`.
    pub(crate) fn new(ty: GgmlType, cols: usize) -> DecodedRow {
        let mut st = DecodedRow {
            q: Vec::new(),
            qabs: Vec::new(),
            d: Vec::new(),
            m: Vec::new(),
            sc: Vec::new(),
            mins: Vec::new(),
            f: Vec::new(),
        };
        st.prepare(ty, cols);
        st
    }

    /// Grow the buffers (never shrink) to hold a row of `cols` weights of type `ty`.
    pub(crate) fn prepare(&mut self, ty: GgmlType, cols: usize) {
        fn at_least<T: Clone + Default>(v: &mut Vec<T>, n: usize) {
            if v.len() < n {
                v.resize(n, T::default());
            }
        }
        let nb = cols / ty.block_size();
        if ty.is_quantized() {
            at_least(&mut self.q, cols);
            if cfg!(target_arch = "x86_64") {
                at_least(&mut self.qabs, cols);
            }
            at_least(&mut self.d, nb);
            at_least(&mut self.m, nb);
        }
        if ty.block_size() == 256 {
            at_least(&mut self.sc, cols / 2);
            at_least(&mut self.mins, cols / 16);
        }
        if matches!(ty, GgmlType::F16 | GgmlType::BF16) {
            at_least(&mut self.f, cols);
        }
    }

    /// Run `f` with this thread's cached buffers prepared for (`ty`, `cols`), so repeated
    /// products do not allocate; falls back to fresh buffers if the cache is in use.
    pub(crate) fn with_cached<R>(
        ty: GgmlType,
        cols: usize,
        f: impl FnOnce(&mut DecodedRow) -> R,
    ) -> R {
        thread_local! {
            static CACHE: std::cell::RefCell<Option<DecodedRow>> = const { std::cell::RefCell::new(None) };
        }
        CACHE.with(|cell| match cell.try_borrow_mut() {
            Ok(mut slot) => {
                let st = slot.get_or_insert_with(|| DecodedRow::new(ty, cols));
                st.prepare(ty, cols);
                f(st)
            }
            Err(_) => f(&mut DecodedRow::new(ty, cols)),
        })
    }
}
