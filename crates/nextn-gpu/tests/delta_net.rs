//! The delta-net kernels against scalar references written from the spec (§4.6, in f64), and
//! the properties the rollback rests on: a batch of rows gives the bits of the same rows decoded
//! one by one, and a verify batch committed in part (buffer swap for all rows, an in-place replay
//! of the kept rows otherwise) leaves exactly the state and window of decoding the kept rows.

use nextn_gpu::kernels::delta_net::{
    conv_silu, conv_window_advance, gated_norm, gates, recurrence, DeltaNetShape, Rows, StateIo,
};
use nextn_gpu::validation::{assert_clean, test_device};
use nextn_gpu::{Gpu, Recorder};

const EPS: f32 = 1e-6;

fn shape(k_heads: u32, v_heads: u32, key_head: u32, value_head: u32, kernel: u32) -> DeltaNetShape {
    DeltaNetShape {
        k_heads,
        v_heads,
        key_head,
        value_head,
        kernel,
    }
}

/// The models' shapes (Hk 16, dk = dv = 128, Kc 4; Hv 16, 32 (35B), 48 (27B)), a small one, and
/// a ragged one: dk not a multiple of the recurrence's 4 parts, dv not a multiple of its 32-column
/// tiles and over the 128 invocations of the norm kernels, Kc 3.
fn shapes() -> Vec<DeltaNetShape> {
    vec![
        shape(2, 4, 32, 32, 4),
        shape(3, 6, 37, 136, 3),
        shape(16, 16, 128, 128, 4),
        shape(16, 32, 128, 128, 4),
        shape(16, 48, 128, 128, 4),
    ]
}

struct Rng(u64);

impl Rng {
    /// Uniform in [-0.5, 0.5).
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    }

    fn vec(&mut self, len: usize, scale: f32) -> Vec<f32> {
        (0..len).map(|_| self.next() * scale).collect()
    }
}

fn upload(gpu: &Gpu, label: &str, data: &[f32]) -> wgpu::Buffer {
    gpu.upload(label, bytemuck::cast_slice(data)).unwrap()
}

fn zeros(gpu: &Gpu, label: &str, len: usize) -> wgpu::Buffer {
    gpu.buffer(label, len as u64 * 4).unwrap()
}

fn read(gpu: &Gpu, buf: &wgpu::Buffer, len: usize) -> Vec<f32> {
    gpu.read_f32(buf, 0, len).unwrap()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// `|got − want| ≤ abs + rel·|want|` everywhere; returns the largest error for the report.
#[track_caller]
fn assert_close(got: &[f32], want: &[f64], abs: f64, rel: f64, what: &str) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst = 0.0f64;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs();
        assert!(
            err <= abs + rel * w.abs(),
            "{what}[{i}]: {g} vs {w} (error {err:e})"
        );
        worst = worst.max(err);
    }
    worst
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// §4.6 step 3-5: conv over [window, raw rows], SiLU, L2 norm of the q and k heads.
fn conv_ref(
    s: &DeltaNetShape,
    window: &[f32],
    raw: &[f32],
    raw_off: usize,
    raw_stride: usize,
    conv_w: &[f32],
    n: usize,
) -> Vec<f64> {
    let (cd, kc) = (s.conv_dim() as usize, s.kernel as usize);
    let x = |r: usize, ch: usize| -> f64 {
        if r < kc - 1 {
            window[r * cd + ch] as f64
        } else {
            raw[raw_off + (r - (kc - 1)) * raw_stride + ch] as f64
        }
    };
    let mut out = vec![0.0f64; n * cd];
    for t in 0..n {
        for ch in 0..cd {
            let sum: f64 = (0..kc)
                .map(|j| x(t + j, ch) * conv_w[ch * kc + j] as f64)
                .sum();
            out[t * cd + ch] = silu(sum);
        }
        let dk = s.key_head as usize;
        for h in 0..2 * s.k_heads as usize {
            let head = &mut out[t * cd + h * dk..t * cd + (h + 1) * dk];
            let norm = head
                .iter()
                .map(|v| v * v)
                .sum::<f64>()
                .sqrt()
                .max(EPS as f64);
            head.iter_mut().for_each(|v| *v /= norm);
        }
    }
    out
}

/// The last Kc−1 rows of [window, raw rows 0..keep].
fn window_ref(
    s: &DeltaNetShape,
    window: &[f32],
    raw: &[f32],
    raw_off: usize,
    raw_stride: usize,
    keep: usize,
) -> Vec<f32> {
    let (cd, kc1) = (s.conv_dim() as usize, s.kernel as usize - 1);
    let mut all: Vec<f32> = window.to_vec();
    for r in 0..keep {
        all.extend_from_slice(&raw[raw_off + r * raw_stride..][..cd]);
    }
    all[all.len() - kc1 * cd..].to_vec()
}

/// (beta, decay), each `n × Hv`.
#[allow(clippy::too_many_arguments)]
fn gates_ref(
    hv: usize,
    ba: &[f32],
    b_off: usize,
    alpha_off: usize,
    stride: usize,
    dt_bias: &[f32],
    a: &[f32],
    n: usize,
) -> (Vec<f64>, Vec<f64>) {
    let mut beta = vec![0.0; n * hv];
    let mut decay = vec![0.0; n * hv];
    for t in 0..n {
        for m in 0..hv {
            let b = ba[b_off + t * stride + m] as f64;
            beta[t * hv + m] = 1.0 / (1.0 + (-b).exp());
            let x = ba[alpha_off + t * stride + m] as f64 + dt_bias[m] as f64;
            let sp = if x > 20.0 { x } else { x.exp().ln_1p() };
            decay[t * hv + m] = (sp * a[m] as f64).exp();
        }
    }
    (beta, decay)
}

/// §4.6 step 6 over `n` rows: (state after the last row, o `n × Hv·dv`).
fn recurrence_ref(
    s: &DeltaNetShape,
    state: &[f32],
    conv: &[f32],
    beta: &[f32],
    decay: &[f32],
    n: usize,
) -> (Vec<f64>, Vec<f64>) {
    let (hk, hv) = (s.k_heads as usize, s.v_heads as usize);
    let (dk, dv, cd) = (
        s.key_head as usize,
        s.value_head as usize,
        s.conv_dim() as usize,
    );
    let key_dim = hk * dk;
    let scale = 1.0 / (dk as f64).sqrt();
    let mut st: Vec<f64> = state.iter().map(|&v| v as f64).collect();
    let mut o = vec![0.0f64; n * hv * dv];
    for t in 0..n {
        let c = &conv[t * cd..(t + 1) * cd];
        for m in 0..hv {
            let g = m % hk;
            let q = &c[g * dk..(g + 1) * dk];
            let k = &c[key_dim + g * dk..key_dim + (g + 1) * dk];
            let v = &c[2 * key_dim + m * dv..2 * key_dim + (m + 1) * dv];
            let sm = &mut st[m * dk * dv..(m + 1) * dk * dv];
            let dec = decay[t * hv + m] as f64;
            sm.iter_mut().for_each(|x| *x *= dec);
            for j in 0..dv {
                let u: f64 = (0..dk).map(|i| sm[i * dv + j] * k[i] as f64).sum();
                let delta = beta[t * hv + m] as f64 * (v[j] as f64 - u);
                for i in 0..dk {
                    sm[i * dv + j] += k[i] as f64 * delta;
                }
                let oj: f64 = (0..dk).map(|i| sm[i * dv + j] * q[i] as f64).sum();
                o[t * hv * dv + m * dv + j] = scale * oj;
            }
        }
    }
    (st, o)
}

/// §4.6 step 7: `y_m = RMSNorm(o_m; w) ⊙ SiLU(z_m)`.
#[allow(clippy::too_many_arguments)]
fn gated_norm_ref(
    hv: usize,
    dv: usize,
    o: &[f32],
    z: &[f32],
    z_off: usize,
    z_stride: usize,
    w: &[f32],
    n: usize,
) -> Vec<f64> {
    let mut y = vec![0.0f64; n * hv * dv];
    for t in 0..n {
        for m in 0..hv {
            let om = &o[(t * hv + m) * dv..][..dv];
            let ms = om.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / dv as f64;
            let scale = 1.0 / (ms + EPS as f64).sqrt();
            for j in 0..dv {
                let zj = z[z_off + t * z_stride + m * dv + j] as f64;
                y[(t * hv + m) * dv + j] = om[j] as f64 * scale * w[j] as f64 * silu(zj);
            }
        }
    }
    y
}

/// Conv rows as the recurrence sees them: q and k heads of unit length, v after a SiLU.
fn conv_rows(s: &DeltaNetShape, rng: &mut Rng, n: usize) -> Vec<f32> {
    let cd = s.conv_dim() as usize;
    let (dk, key_dim) = (s.key_head as usize, s.key_dim() as usize);
    let mut c = rng.vec(n * cd, 2.0);
    for t in 0..n {
        for h in 0..2 * s.k_heads as usize {
            let head = &mut c[t * cd + h * dk..t * cd + (h + 1) * dk];
            let norm = head.iter().map(|v| v * v).sum::<f32>().sqrt();
            head.iter_mut().for_each(|v| *v /= norm);
        }
        for v in &mut c[t * cd + 2 * key_dim..(t + 1) * cd] {
            *v = *v / (1.0 + (-*v).exp());
        }
    }
    c
}

#[test]
fn conv_silu_and_window_match_the_definition() {
    let Some(gpu) = test_device() else { return };
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut shapes = shapes();
    shapes.push(shape(2, 2, 16, 16, 1));
    let mut worst = 0.0f64;
    for s in &shapes {
        let cd = s.conv_dim() as usize;
        for n in [1usize, 5] {
            // Raw rows strided and offset as in a wider projection output.
            let (raw_off, raw_stride) = (7usize, cd + 5);
            let raw = rng.vec(raw_off + n * raw_stride, 4.0);
            let window = rng.vec(s.window_len() as usize, 4.0);
            let conv_w = rng.vec(cd * s.kernel as usize, 1.0);
            let (raw_b, win_b, w_b) = (
                upload(&gpu, "raw", &raw),
                upload(&gpu, "window", &window),
                upload(&gpu, "conv_w", &conv_w),
            );
            let out_b = zeros(&gpu, "conv", n * cd);
            let rows = Rows {
                buffer: &raw_b,
                offset: raw_off as u32,
                stride: raw_stride as u32,
            };
            let mut rec = Recorder::new(&gpu);
            conv_silu(&mut rec, s, rows, n as u32, &win_b, &w_b, EPS, &out_b).unwrap();
            rec.submit(false).unwrap();
            let want = conv_ref(s, &window, &raw, raw_off, raw_stride, &conv_w, n);
            let got = read(&gpu, &out_b, n * cd);
            worst = worst.max(assert_close(
                &got,
                &want,
                1e-6,
                1e-5,
                &format!("conv {s:?} n {n}"),
            ));
            // The conv leaves its window alone.
            assert_eq!(bits(&read(&gpu, &win_b, window.len())), bits(&window));

            for keep in 0..=n {
                let win_b = upload(&gpu, "window", &window);
                let mut rec = Recorder::new(&gpu);
                conv_window_advance(&mut rec, s, &win_b, rows, keep as u32).unwrap();
                rec.submit(false).unwrap();
                let want = window_ref(s, &window, &raw, raw_off, raw_stride, keep);
                assert_eq!(
                    bits(&read(&gpu, &win_b, window.len())),
                    bits(&want),
                    "window {s:?} keep {keep}"
                );
            }
        }
    }
    eprintln!("conv + SiLU + L2: largest error {worst:e}");
    assert_clean(&gpu);
}

#[test]
fn gates_match_the_definition() {
    let Some(gpu) = test_device() else { return };
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    let mut worst = (0.0f64, 0.0f64);
    for hv in [4usize, 6, 32, 48] {
        let s = shape(1, hv as u32, 16, 16, 4);
        let n = 9;
        // b and alpha side by side in one projection output, as a fused projection leaves them.
        let stride = 2 * hv + 1;
        let mut ba = rng.vec(n * stride, 16.0);
        // Reach both sides of softplus's threshold and far into its tail.
        ba[hv] = 30.0;
        ba[hv + 1] = -30.0;
        let dt_bias = rng.vec(hv, 4.0);
        let a: Vec<f32> = rng.vec(hv, 1.0).iter().map(|v| -(v * 4.0).exp()).collect();
        let (ba_b, dt_b, a_b) = (
            upload(&gpu, "ba", &ba),
            upload(&gpu, "dt_bias", &dt_bias),
            upload(&gpu, "a", &a),
        );
        let (beta_b, decay_b) = (zeros(&gpu, "beta", n * hv), zeros(&gpu, "decay", n * hv));
        let mut rec = Recorder::new(&gpu);
        gates(
            &mut rec,
            &s,
            Rows {
                buffer: &ba_b,
                offset: 0,
                stride: stride as u32,
            },
            Rows {
                buffer: &ba_b,
                offset: hv as u32,
                stride: stride as u32,
            },
            &dt_b,
            &a_b,
            n as u32,
            &beta_b,
            &decay_b,
        )
        .unwrap();
        rec.submit(false).unwrap();
        let (beta, decay) = gates_ref(hv, &ba, 0, hv, stride, &dt_bias, &a, n);
        let got_beta = read(&gpu, &beta_b, n * hv);
        let got_decay = read(&gpu, &decay_b, n * hv);
        worst.0 = worst
            .0
            .max(assert_close(&got_beta, &beta, 1e-7, 2e-6, "beta"));
        worst.1 = worst
            .1
            .max(assert_close(&got_decay, &decay, 1e-7, 2e-5, "decay"));
    }
    eprintln!(
        "gates: largest error beta {:e}, decay {:e}",
        worst.0, worst.1
    );
    assert_clean(&gpu);
}

#[test]
fn recurrence_matches_the_definition() {
    let Some(gpu) = test_device() else { return };
    let mut rng = Rng(0x0123_4567_89AB_CDEF);
    let mut worst = (0.0f64, 0.0f64);
    for s in &shapes() {
        let (hv, vd) = (s.v_heads as usize, s.value_dim() as usize);
        let sl = s.state_len() as usize;
        for n in [1usize, 6] {
            let conv = conv_rows(s, &mut rng, n);
            let beta: Vec<f32> = rng.vec(n * hv, 1.0).iter().map(|v| v + 0.5).collect();
            let decay: Vec<f32> = rng.vec(n * hv, 0.5).iter().map(|v| v + 0.75).collect();
            let state = rng.vec(sl, 1.0);
            let (conv_b, beta_b, decay_b) = (
                upload(&gpu, "conv", &conv),
                upload(&gpu, "beta", &beta),
                upload(&gpu, "decay", &decay),
            );
            let (want_state, want_o) = recurrence_ref(s, &state, &conv, &beta, &decay, n);
            for in_place in [false, true] {
                let state_in = upload(&gpu, "state", &state);
                let state_out = zeros(&gpu, "state-out", sl);
                let out_b = zeros(&gpu, "o", n * vd);
                let io = if in_place {
                    StateIo::InPlace(&state_in)
                } else {
                    StateIo::Separate {
                        input: &state_in,
                        output: &state_out,
                    }
                };
                let mut rec = Recorder::new(&gpu);
                recurrence(
                    &mut rec, s, io, &conv_b, &beta_b, &decay_b, n as u32, &out_b,
                )
                .unwrap();
                rec.submit(false).unwrap();
                let what = format!("{s:?} n {n} in place {in_place}");
                let got_state = read(&gpu, if in_place { &state_in } else { &state_out }, sl);
                worst.0 = worst.0.max(assert_close(
                    &got_state,
                    &want_state,
                    1e-6,
                    1e-5,
                    &format!("state {what}"),
                ));
                let got_o = read(&gpu, &out_b, n * vd);
                worst.1 = worst.1.max(assert_close(
                    &got_o,
                    &want_o,
                    1e-6,
                    1e-5,
                    &format!("o {what}"),
                ));
                if !in_place {
                    assert_eq!(
                        bits(&read(&gpu, &state_in, sl)),
                        bits(&state),
                        "the input state changed, {what}"
                    );
                }
            }
        }
        // No rows: the output state is the input state.
        let state = rng.vec(sl, 1.0);
        let (state_in, state_out) = (upload(&gpu, "state", &state), zeros(&gpu, "state-out", sl));
        let (c, b, o) = (
            zeros(&gpu, "c", 1),
            zeros(&gpu, "b", 1),
            zeros(&gpu, "o", 1),
        );
        let mut rec = Recorder::new(&gpu);
        let io = StateIo::Separate {
            input: &state_in,
            output: &state_out,
        };
        recurrence(&mut rec, s, io, &c, &b, &b, 0, &o).unwrap();
        rec.submit(false).unwrap();
        assert_eq!(bits(&read(&gpu, &state_out, sl)), bits(&state));
    }
    eprintln!(
        "recurrence: largest error state {:e}, o {:e}",
        worst.0, worst.1
    );
    assert_clean(&gpu);
}

#[test]
fn gated_norm_matches_the_definition() {
    let Some(gpu) = test_device() else { return };
    let mut rng = Rng(0x5DEE_CE66_D1CE_4E5B);
    let mut worst = 0.0f64;
    for s in &shapes() {
        let (hv, dv, vd) = (
            s.v_heads as usize,
            s.value_head as usize,
            s.value_dim() as usize,
        );
        let n = 3;
        let o = rng.vec(n * vd, 0.2);
        let (z_off, z_stride) = (3usize, vd + 11);
        let z = rng.vec(z_off + n * z_stride, 8.0);
        let w: Vec<f32> = rng.vec(dv, 1.0).iter().map(|v| v + 1.0).collect();
        let (o_b, z_b, w_b) = (
            upload(&gpu, "o", &o),
            upload(&gpu, "z", &z),
            upload(&gpu, "w", &w),
        );
        let y_b = zeros(&gpu, "y", n * vd);
        let mut rec = Recorder::new(&gpu);
        gated_norm(
            &mut rec,
            s,
            &o_b,
            Rows {
                buffer: &z_b,
                offset: z_off as u32,
                stride: z_stride as u32,
            },
            &w_b,
            n as u32,
            EPS,
            &y_b,
        )
        .unwrap();
        rec.submit(false).unwrap();
        let want = gated_norm_ref(hv, dv, &o, &z, z_off, z_stride, &w, n);
        worst = worst.max(assert_close(
            &read(&gpu, &y_b, n * vd),
            &want,
            1e-6,
            1e-5,
            &format!("gated norm {s:?}"),
        ));
    }
    eprintln!("gated norm: largest error {worst:e}");
    assert_clean(&gpu);
}

/// One sequence's layer inputs and weights on the device.
struct Layer {
    s: DeltaNetShape,
    raw: wgpu::Buffer,
    raw_off: u32,
    raw_stride: u32,
    z: wgpu::Buffer,
    ba: wgpu::Buffer,
    conv_w: wgpu::Buffer,
    dt_bias: wgpu::Buffer,
    a: wgpu::Buffer,
    norm_w: wgpu::Buffer,
}

/// What a pass over some rows produced.
struct RowOutputs {
    conv: wgpu::Buffer,
    beta: wgpu::Buffer,
    decay: wgpu::Buffer,
    o: wgpu::Buffer,
    y: wgpu::Buffer,
}

impl Layer {
    fn new(gpu: &Gpu, s: DeltaNetShape, n: usize, rng: &mut Rng) -> Layer {
        let (cd, vd, hv) = (
            s.conv_dim() as usize,
            s.value_dim() as usize,
            s.v_heads as usize,
        );
        let (raw_off, raw_stride) = (3u32, cd as u32 + 2);
        Layer {
            s,
            raw: upload(
                gpu,
                "raw",
                &rng.vec(raw_off as usize + n * raw_stride as usize, 4.0),
            ),
            raw_off,
            raw_stride,
            z: upload(gpu, "z", &rng.vec(n * vd, 8.0)),
            ba: upload(gpu, "ba", &rng.vec(n * 2 * hv, 8.0)),
            conv_w: upload(gpu, "conv_w", &rng.vec(cd * s.kernel as usize, 1.0)),
            dt_bias: upload(gpu, "dt_bias", &rng.vec(hv, 2.0)),
            a: upload(
                gpu,
                "a",
                &rng.vec(hv, 1.0)
                    .iter()
                    .map(|v| -(v * 2.0).exp())
                    .collect::<Vec<_>>(),
            ),
            norm_w: upload(
                gpu,
                "norm",
                &rng.vec(s.value_head as usize, 1.0)
                    .iter()
                    .map(|v| v + 1.0)
                    .collect::<Vec<_>>(),
            ),
        }
    }

    fn raw_rows(&self, first: u32) -> Rows<'_> {
        Rows {
            buffer: &self.raw,
            offset: self.raw_off + first * self.raw_stride,
            stride: self.raw_stride,
        }
    }

    /// Rows `first..first + n` through conv, gates, recurrence and gated norm, from `window` and
    /// the state in `state`; the window is left as it was.
    fn forward(
        &self,
        gpu: &Gpu,
        rec: &mut Recorder,
        first: u32,
        n: u32,
        window: &wgpu::Buffer,
        state: StateIo,
    ) -> RowOutputs {
        let s = &self.s;
        let (cd, hv, vd) = (s.conv_dim(), s.v_heads, s.value_dim());
        let len = |w: u32| (n * w) as usize;
        let r = RowOutputs {
            conv: zeros(gpu, "conv", len(cd)),
            beta: zeros(gpu, "beta", len(hv)),
            decay: zeros(gpu, "decay", len(hv)),
            o: zeros(gpu, "o", len(vd)),
            y: zeros(gpu, "y", len(vd)),
        };
        conv_silu(
            rec,
            s,
            self.raw_rows(first),
            n,
            window,
            &self.conv_w,
            EPS,
            &r.conv,
        )
        .unwrap();
        let ba = |off: u32| Rows {
            buffer: &self.ba,
            offset: first * 2 * hv + off,
            stride: 2 * hv,
        };
        gates(
            rec,
            s,
            ba(0),
            ba(hv),
            &self.dt_bias,
            &self.a,
            n,
            &r.beta,
            &r.decay,
        )
        .unwrap();
        recurrence(rec, s, state, &r.conv, &r.beta, &r.decay, n, &r.o).unwrap();
        let z = Rows {
            buffer: &self.z,
            offset: first * vd,
            stride: vd,
        };
        gated_norm(rec, s, &r.o, z, &self.norm_w, n, EPS, &r.y).unwrap();
        r
    }
}

#[test]
fn a_batch_equals_its_rows_one_by_one_and_commit_keeps_any_prefix_exactly() {
    let Some(gpu) = test_device() else { return };
    let mut rng = Rng(0xD1B5_4A32_D192_ED03);
    for s in [
        shape(2, 4, 32, 32, 4),
        shape(3, 6, 37, 136, 3),
        shape(16, 32, 128, 128, 4),
    ] {
        let n = 6u32;
        let (cd, hv, vd, sl) = (
            s.conv_dim() as usize,
            s.v_heads as usize,
            s.value_dim() as usize,
            s.state_len() as usize,
        );
        let layer = Layer::new(&gpu, s, n as usize, &mut rng);
        let window0 = rng.vec(s.window_len() as usize, 4.0);
        let state0 = rng.vec(sl, 1.0);

        // Decode: one row per pass, the state in place; what each row gave and the state and
        // window after every row.
        let (window, state) = (
            upload(&gpu, "window", &window0),
            upload(&gpu, "state", &state0),
        );
        let mut decoded: Vec<[Vec<f32>; 5]> = Vec::new();
        let mut after = vec![(window0.clone(), state0.clone())];
        for t in 0..n {
            let mut rec = Recorder::new(&gpu);
            let r = layer.forward(&gpu, &mut rec, t, 1, &window, StateIo::InPlace(&state));
            conv_window_advance(&mut rec, &s, &window, layer.raw_rows(t), 1).unwrap();
            rec.submit(false).unwrap();
            decoded.push([
                read(&gpu, &r.conv, cd),
                read(&gpu, &r.beta, hv),
                read(&gpu, &r.decay, hv),
                read(&gpu, &r.o, vd),
                read(&gpu, &r.y, vd),
            ]);
            after.push((read(&gpu, &window, window0.len()), read(&gpu, &state, sl)));
        }

        // Verify: all rows in one pass from the committed state into a spare one.
        let (committed_window, committed) = (
            upload(&gpu, "window", &window0),
            upload(&gpu, "state", &state0),
        );
        let spare = zeros(&gpu, "spare", sl);
        let mut rec = Recorder::new(&gpu);
        let verify = layer.forward(
            &gpu,
            &mut rec,
            0,
            n,
            &committed_window,
            StateIo::Separate {
                input: &committed,
                output: &spare,
            },
        );
        rec.submit(false).unwrap();
        let batch = [
            (read(&gpu, &verify.conv, n as usize * cd), cd, "conv"),
            (read(&gpu, &verify.beta, n as usize * hv), hv, "beta"),
            (read(&gpu, &verify.decay, n as usize * hv), hv, "decay"),
            (read(&gpu, &verify.o, n as usize * vd), vd, "o"),
            (read(&gpu, &verify.y, n as usize * vd), vd, "y"),
        ];
        for (t, row) in decoded.iter().enumerate() {
            for ((all, width, what), one) in batch.iter().zip(row) {
                assert_eq!(
                    bits(&all[t * width..(t + 1) * width]),
                    bits(one),
                    "{s:?}: {what} of row {t} in a batch and alone"
                );
            }
        }
        assert_eq!(
            bits(&read(&gpu, &spare, sl)),
            bits(&after[n as usize].1),
            "{s:?}: state after the batch and after its rows one by one"
        );
        assert_eq!(bits(&read(&gpu, &committed, sl)), bits(&state0));
        assert_eq!(
            bits(&read(&gpu, &committed_window, window0.len())),
            bits(&window0)
        );

        // Commit each prefix of the verify rows from a fresh copy of the committed state.
        let scratch = zeros(&gpu, "o-replay", n as usize * vd);
        for keep in 0..=n {
            let (window, committed) = (
                upload(&gpu, "window", &window0),
                upload(&gpu, "state", &state0),
            );
            let mut rec = Recorder::new(&gpu);
            let state = if keep == n {
                &spare
            } else {
                let io = StateIo::InPlace(&committed);
                recurrence(
                    &mut rec,
                    &s,
                    io,
                    &verify.conv,
                    &verify.beta,
                    &verify.decay,
                    keep,
                    &scratch,
                )
                .unwrap();
                &committed
            };
            conv_window_advance(&mut rec, &s, &window, layer.raw_rows(0), keep).unwrap();
            rec.submit(false).unwrap();
            let (want_window, want_state) = &after[keep as usize];
            assert_eq!(
                bits(&read(&gpu, state, sl)),
                bits(want_state),
                "{s:?}: state after committing {keep} of {n}"
            );
            assert_eq!(
                bits(&read(&gpu, &window, window0.len())),
                bits(want_window),
                "{s:?}: window after committing {keep} of {n}"
            );
        }
    }
    assert_clean(&gpu);
}

#[test]
fn shapes_and_buffers_the_kernels_cannot_take_are_refused() {
    let Some(gpu) = test_device() else { return };
    let big = shape(1, 1, 129, 16, 4);
    let b = zeros(&gpu, "b", 1 << 16);
    let mut rec = Recorder::new(&gpu);
    assert!(recurrence(&mut rec, &big, StateIo::InPlace(&b), &b, &b, &b, 1, &b).is_err());
    let s = shape(2, 4, 32, 32, 4);
    let small = zeros(&gpu, "small", s.state_len() as usize - 1);
    assert!(recurrence(&mut rec, &s, StateIo::InPlace(&small), &b, &b, &b, 1, &b).is_err());
    let window = zeros(&gpu, "window", s.window_len() as usize);
    let raw = zeros(&gpu, "raw", 2 * s.conv_dim() as usize);
    let raw_rows = Rows::packed(&raw, s.conv_dim());
    assert!(conv_silu(&mut rec, &s, raw_rows, 2, &window, &b, EPS, &b).is_ok());
    assert!(
        conv_silu(&mut rec, &s, raw_rows, 3, &window, &b, EPS, &b).is_err(),
        "raw rows past the buffer's end"
    );
    assert!(
        conv_window_advance(&mut rec, &s, &small, raw_rows, 3).is_err(),
        "kept rows past the buffer's end"
    );
    assert_eq!(rec.len(), 1);
    assert_clean(&gpu);
}

/// Every test above again at lavapipe's 4, 8 and 16 lanes.
#[test]
fn at_every_lavapipe_width() {
    nextn_gpu::validation::rerun_at_lavapipe_widths("at_every_lavapipe_width");
}
