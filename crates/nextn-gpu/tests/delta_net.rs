//! The delta-net kernels against scalar references written from the spec (§4.6, in f64), and
//! the properties the rollback rests on: a batch of rows gives the bits of the same rows decoded
//! one by one, and a verify batch committed in part (buffer swaps for all rows, an in-place replay
//! of the kept rows from their raw projections otherwise) leaves exactly the state and window of
//! decoding the kept rows.

use nextn_gpu::kernels::delta_net::{
    gated_norm, step, DeltaNetShape, RawRows, Rows, StepIo, StepWeights,
};
use nextn_gpu::kernels::matvec::QuantOut;
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
/// a ragged one: dk not a multiple of the recurrence's 8 parts, dv not a multiple of its 16-column
/// tiles and over the 128 invocations of the norm's halves, Kc 3.
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

/// One sequence's layer inputs and weights on the device: raw rows laid out as a stacked
/// projection leaves them ([q|k|v], then β and α further along the row, the rows strided and
/// offset), the small weights in one buffer as a layer keeps them.
struct Layer {
    s: DeltaNetShape,
    raw_host: Vec<f32>,
    raw: wgpu::Buffer,
    raw_off: u32,
    raw_stride: u32,
    beta_col: u32,
    alpha_col: u32,
    vecs_host: Vec<f32>,
    vecs: wgpu::Buffer,
}

impl Layer {
    fn new(gpu: &Gpu, s: DeltaNetShape, n: usize, rng: &mut Rng) -> Layer {
        let (cd, hv) = (s.conv_dim() as usize, s.v_heads as usize);
        // [q|k|v] | 5 other values | β | α | 2 more.
        let (raw_off, raw_stride) = (3u32, (cd + 5 + 2 * hv + 2) as u32);
        let mut raw_host = rng.vec(raw_off as usize + n * raw_stride as usize, 4.0);
        // β and α wide enough to reach both sides of softplus's threshold.
        for t in 0..n {
            for m in 0..2 * hv {
                raw_host[raw_off as usize + t * raw_stride as usize + cd + 5 + m] *= 4.0;
            }
        }
        if n > 0 && hv > 1 {
            raw_host[raw_off as usize + cd + 5 + hv] = 30.0;
            raw_host[raw_off as usize + cd + 5 + hv + 1] = -30.0;
        }
        let conv_w = rng.vec(cd * s.kernel as usize, 1.0);
        let dt_bias = rng.vec(hv, 2.0);
        let a: Vec<f32> = rng.vec(hv, 1.0).iter().map(|v| -(v * 2.0).exp()).collect();
        let vecs_host: Vec<f32> = conv_w.iter().chain(&dt_bias).chain(&a).copied().collect();
        Layer {
            s,
            raw: upload(gpu, "raw", &raw_host),
            raw_host,
            raw_off,
            raw_stride,
            beta_col: (cd + 5) as u32,
            alpha_col: (cd + 5 + hv) as u32,
            vecs: upload(gpu, "vecs", &vecs_host),
            vecs_host,
        }
    }

    fn raw_rows(&self, first: u32) -> RawRows<'_> {
        RawRows {
            rows: Rows {
                buffer: &self.raw,
                offset: self.raw_off + first * self.raw_stride,
                stride: self.raw_stride,
            },
            beta_col: self.beta_col,
            alpha_col: self.alpha_col,
        }
    }

    fn weights(&self) -> StepWeights<'_> {
        let (cd, kc, hv) = (self.s.conv_dim(), self.s.kernel, self.s.v_heads);
        StepWeights {
            buffer: &self.vecs,
            conv: 0,
            dt_bias: cd * kc,
            a: cd * kc + hv,
        }
    }

    /// The reference over rows `first..first + n` from `window` and `state`: (state after, o).
    fn reference(
        &self,
        first: usize,
        n: usize,
        window: &[f32],
        state: &[f32],
    ) -> (Vec<f64>, Vec<f64>) {
        let s = &self.s;
        let (cd, kc, hv) = (s.conv_dim() as usize, s.kernel as usize, s.v_heads as usize);
        let off = self.raw_off as usize + first * self.raw_stride as usize;
        let stride = self.raw_stride as usize;
        let conv = conv_ref(
            s,
            window,
            &self.raw_host,
            off,
            stride,
            &self.vecs_host[..cd * kc],
            n,
        );
        let conv: Vec<f32> = conv.iter().map(|&v| v as f32).collect();
        let dt_bias = &self.vecs_host[cd * kc..cd * kc + hv];
        let a = &self.vecs_host[cd * kc + hv..];
        let (beta, decay) = gates_ref(
            hv,
            &self.raw_host,
            off + self.beta_col as usize,
            off + self.alpha_col as usize,
            stride,
            dt_bias,
            a,
            n,
        );
        let beta: Vec<f32> = beta.iter().map(|&v| v as f32).collect();
        let decay: Vec<f32> = decay.iter().map(|&v| v as f32).collect();
        recurrence_ref(s, state, &conv, &beta, &decay, n)
    }
}

/// The conv, norms, gates and recurrence in one kernel against their definitions, in place and
/// into a spare state, with the window after the rows and the raw rows a replay needs.
#[test]
fn step_matches_the_definition() {
    let Some(gpu) = test_device() else { return };
    let mut rng = Rng(0x0123_4567_89AB_CDEF);
    let mut worst = (0.0f64, 0.0f64);
    let mut shapes = shapes();
    shapes.push(shape(2, 2, 16, 16, 1));
    for s in &shapes {
        let (cd, hv, vd, sl) = (
            s.conv_dim() as usize,
            s.v_heads as usize,
            s.value_dim() as usize,
            s.state_len() as usize,
        );
        for n in [1usize, 6] {
            let layer = Layer::new(&gpu, *s, n, &mut rng);
            let window = rng.vec(s.window_len() as usize, 4.0);
            let state = rng.vec(sl, 1.0);
            let (want_state, want_o) = layer.reference(0, n, &window, &state);
            let want_window = window_ref(
                s,
                &window,
                &layer.raw_host,
                layer.raw_off as usize,
                layer.raw_stride as usize,
                n,
            );
            for verify in [false, true] {
                // The committed copies second in their buffers, the other copies first.
                let wl = window.len();
                let states: Vec<f32> = vec![0.0; sl].into_iter().chain(state.clone()).collect();
                let windows: Vec<f32> = vec![0.0; wl].into_iter().chain(window.clone()).collect();
                let (states_b, windows_b) = (
                    upload(&gpu, "states", &states),
                    upload(&gpu, "windows", &[windows.as_slice(), &[0.0]].concat()),
                );
                let keep = zeros(&gpu, "keep", n * (cd + 2 * hv));
                // o rows strided and offset as in a pass's buffer.
                let (o_off, o_stride) = (5usize, vd + 3);
                let o = zeros(&gpu, "o", o_off + n * o_stride);
                let io = StepIo {
                    states: &states_b,
                    state: sl as u32,
                    state_out: if verify { 0 } else { sl as u32 },
                    windows: &windows_b,
                    window: wl as u32,
                    window_out: (s.kernel > 1).then_some(0),
                    keep: verify.then_some(&keep),
                };
                let mut rec = Recorder::new(&gpu);
                let out = Rows {
                    buffer: &o,
                    offset: o_off as u32,
                    stride: o_stride as u32,
                };
                step(
                    &mut rec,
                    s,
                    &layer.raw_rows(0),
                    &layer.weights(),
                    &io,
                    n as u32,
                    EPS,
                    out,
                )
                .unwrap();
                rec.submit(false).unwrap();
                let what = format!("{s:?} n {n} verify {verify}");
                let all_states = read(&gpu, &states_b, 2 * sl);
                let got_state = if verify {
                    &all_states[..sl]
                } else {
                    &all_states[sl..]
                };
                worst.0 = worst.0.max(assert_close(
                    got_state,
                    &want_state,
                    1e-6,
                    1e-5,
                    &format!("state {what}"),
                ));
                let all_o = read(&gpu, &o, o_off + n * o_stride);
                let got_o: Vec<f32> = (0..n)
                    .flat_map(|t| all_o[o_off + t * o_stride..][..vd].to_vec())
                    .collect();
                worst.1 = worst.1.max(assert_close(
                    &got_o,
                    &want_o,
                    1e-6,
                    1e-5,
                    &format!("o {what}"),
                ));
                let all_windows = read(&gpu, &windows_b, 2 * wl);
                if s.kernel > 1 {
                    assert_eq!(
                        bits(&all_windows[..wl]),
                        bits(&want_window),
                        "window after the rows, {what}"
                    );
                }
                assert_eq!(
                    bits(&all_windows[wl..]),
                    bits(&window),
                    "the window changed, {what}"
                );
                if verify {
                    assert_eq!(
                        bits(&all_states[sl..]),
                        bits(&state),
                        "the committed state changed, {what}"
                    );
                    // The kept rows: [q|k|v | β | α] of every row as the projection gave them.
                    let kept = read(&gpu, &keep, n * (cd + 2 * hv));
                    for t in 0..n {
                        let r = &layer.raw_host
                            [layer.raw_off as usize + t * layer.raw_stride as usize..];
                        let want: Vec<f32> = r[..cd]
                            .iter()
                            .chain(&r[layer.beta_col as usize..][..hv])
                            .chain(&r[layer.alpha_col as usize..][..hv])
                            .copied()
                            .collect();
                        assert_eq!(
                            bits(&kept[t * (cd + 2 * hv)..(t + 1) * (cd + 2 * hv)]),
                            bits(&want),
                            "kept raw row {t}, {what}"
                        );
                    }
                }
            }
        }
    }
    eprintln!("step: largest error state {:e}, o {:e}", worst.0, worst.1);
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
            Rows::packed(&o_b, vd as u32),
            Rows {
                buffer: &z_b,
                offset: z_off as u32,
                stride: z_stride as u32,
            },
            &w_b,
            n as u32,
            EPS,
            Rows::packed(&y_b, vd as u32),
            &QuantOut::default(),
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
        let nu = n as usize;
        let (cd, hv, vd, sl) = (
            s.conv_dim() as usize,
            s.v_heads as usize,
            s.value_dim() as usize,
            s.state_len() as usize,
        );
        let wl = s.window_len() as usize;
        let layer = Layer::new(&gpu, s, nu, &mut rng);
        let window0 = rng.vec(wl, 4.0);
        let state0 = rng.vec(sl, 1.0);

        // Decode: one row per pass, the state in place, the window into the other copy, which
        // becomes the committed one; what each row gave and the state and window after every
        // row.
        let states = upload(
            &gpu,
            "states",
            &[state0.as_slice(), &vec![0.0; sl]].concat(),
        );
        let windows = upload(
            &gpu,
            "windows",
            &[window0.as_slice(), &vec![0.0; wl]].concat(),
        );
        let mut at = 0u32;
        let mut decoded: Vec<Vec<f32>> = Vec::new();
        let mut after = vec![(window0.clone(), state0.clone())];
        for t in 0..n {
            let o = zeros(&gpu, "o", vd);
            let io = StepIo {
                states: &states,
                state: 0,
                state_out: 0,
                windows: &windows,
                window: at * wl as u32,
                window_out: Some((1 - at) * wl as u32),
                keep: None,
            };
            let mut rec = Recorder::new(&gpu);
            step(
                &mut rec,
                &s,
                &layer.raw_rows(t),
                &layer.weights(),
                &io,
                1,
                EPS,
                Rows::packed(&o, vd as u32),
            )
            .unwrap();
            rec.submit(false).unwrap();
            at = 1 - at;
            decoded.push(read(&gpu, &o, vd));
            let w = read(&gpu, &windows, 2 * wl);
            after.push((
                w[at as usize * wl..][..wl].to_vec(),
                read(&gpu, &states, sl),
            ));
        }

        // Verify: all rows in one pass from the committed copies into the other ones.
        let states = upload(
            &gpu,
            "states",
            &[state0.as_slice(), &vec![0.0; sl]].concat(),
        );
        let windows = upload(
            &gpu,
            "windows",
            &[window0.as_slice(), &vec![0.0; wl]].concat(),
        );
        let keep = zeros(&gpu, "keep", nu * (cd + 2 * hv));
        let o = zeros(&gpu, "o", nu * vd);
        let io = StepIo {
            states: &states,
            state: 0,
            state_out: sl as u32,
            windows: &windows,
            window: 0,
            window_out: Some(wl as u32),
            keep: Some(&keep),
        };
        let mut rec = Recorder::new(&gpu);
        step(
            &mut rec,
            &s,
            &layer.raw_rows(0),
            &layer.weights(),
            &io,
            n,
            EPS,
            Rows::packed(&o, vd as u32),
        )
        .unwrap();
        rec.submit(false).unwrap();
        let batch = read(&gpu, &o, nu * vd);
        for (t, one) in decoded.iter().enumerate() {
            assert_eq!(
                bits(&batch[t * vd..(t + 1) * vd]),
                bits(one),
                "{s:?}: o of row {t} in a batch and alone"
            );
        }
        let (all_states, all_windows) = (read(&gpu, &states, 2 * sl), read(&gpu, &windows, 2 * wl));
        assert_eq!(
            bits(&all_states[sl..]),
            bits(&after[nu].1),
            "{s:?}: state after the batch and after its rows one by one"
        );
        assert_eq!(
            bits(&all_windows[wl..]),
            bits(&after[nu].0),
            "{s:?}: window after the batch and after its rows one by one"
        );
        assert_eq!(bits(&all_states[..sl]), bits(&state0));
        assert_eq!(bits(&all_windows[..wl]), bits(&window0));

        // Commit each prefix of the verify rows: all of them are the other copies; fewer are a
        // replay of the kept raw rows in place on a fresh copy of the committed state.
        let replay_out = zeros(&gpu, "o-replay", nu * vd);
        for k in 1..n {
            let states = upload(
                &gpu,
                "states",
                &[state0.as_slice(), &vec![0.0; sl]].concat(),
            );
            let windows = upload(
                &gpu,
                "windows",
                &[window0.as_slice(), &vec![0.0; wl]].concat(),
            );
            let raw = RawRows {
                rows: Rows::packed(&keep, (cd + 2 * hv) as u32),
                beta_col: cd as u32,
                alpha_col: (cd + hv) as u32,
            };
            let io = StepIo {
                states: &states,
                state: 0,
                state_out: 0,
                windows: &windows,
                window: 0,
                window_out: Some(wl as u32),
                keep: None,
            };
            let mut rec = Recorder::new(&gpu);
            step(
                &mut rec,
                &s,
                &raw,
                &layer.weights(),
                &io,
                k,
                EPS,
                Rows::packed(&replay_out, vd as u32),
            )
            .unwrap();
            rec.submit(false).unwrap();
            let (want_window, want_state) = &after[k as usize];
            assert_eq!(
                bits(&read(&gpu, &states, sl)),
                bits(want_state),
                "{s:?}: state after committing {k} of {n}"
            );
            assert_eq!(
                bits(&read(&gpu, &windows, 2 * wl)[wl..]),
                bits(want_window),
                "{s:?}: window after committing {k} of {n}"
            );
        }
    }
    assert_clean(&gpu);
}

#[test]
fn shapes_and_buffers_the_kernels_cannot_take_are_refused() {
    let Some(gpu) = test_device() else { return };
    let b = zeros(&gpu, "b", 1 << 16);
    let w = StepWeights {
        buffer: &b,
        conv: 0,
        dt_bias: 0,
        a: 0,
    };
    let raw_of = |buf, width| RawRows {
        rows: Rows::packed(buf, width),
        beta_col: 0,
        alpha_col: 0,
    };
    let io = |states| StepIo {
        states,
        state: 0,
        state_out: 0,
        windows: &b,
        window: 0,
        window_out: None,
        keep: None,
    };
    let mut rec = Recorder::new(&gpu);
    let out = Rows::packed(&b, 16);
    // A key head past the kernel's.
    let big = shape(1, 1, 129, 16, 4);
    let raw_big = raw_of(&b, big.conv_dim());
    assert!(step(&mut rec, &big, &raw_big, &w, &io(&b), 1, EPS, out).is_err());
    let s = shape(2, 4, 32, 32, 4);
    let small = zeros(&gpu, "small", s.state_len() as usize - 1);
    let raw = zeros(&gpu, "raw", 2 * s.conv_dim() as usize);
    let raw_rows = raw_of(&raw, s.conv_dim());
    assert!(
        step(&mut rec, &s, &raw_rows, &w, &io(&small), 1, EPS, out).is_err(),
        "a state too small"
    );
    assert!(step(&mut rec, &s, &raw_rows, &w, &io(&b), 2, EPS, out).is_ok());
    assert!(
        step(&mut rec, &s, &raw_rows, &w, &io(&b), 3, EPS, out).is_err(),
        "raw rows past the buffer's end"
    );
    // The state after the rows overlapping the state before them, the window after them on
    // the window.
    let overlap = StepIo {
        state_out: 8,
        ..io(&b)
    };
    assert!(step(&mut rec, &s, &raw_rows, &w, &overlap, 1, EPS, out).is_err());
    let same = StepIo {
        window_out: Some(0),
        ..io(&b)
    };
    assert!(step(&mut rec, &s, &raw_rows, &w, &same, 1, EPS, out).is_err());
    assert_eq!(rec.len(), 1);
    assert_clean(&gpu);
}

/// Every test above again at lavapipe's 4, 8 and 16 lanes.
#[test]
fn at_every_lavapipe_width() {
    nextn_gpu::validation::rerun_at_lavapipe_widths("at_every_lavapipe_width");
}
