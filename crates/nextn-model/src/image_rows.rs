//! Image embeddings through the trunk: rows that come from a vision tower instead of the token
//! embedding, at M-RoPE (temporal, height, width) positions, as llama.cpp's mtmd decodes an image
//! chunk: every token of an `nx x ny` image at `(p0, p0 + row, p0 + col)`, and the rotary
//! position after it advanced by `max(nx, ny)`, not by its `nx * ny` cache rows. With the model
//! on a device the rows go through its layers there (after the CPU's first layers, when split)
//! at the same positions.

use nextn_quant::kernels::ThreadPool;

use crate::batch::{finish_pass, BatchItem, ForwardOutput, LogitRows, Readback, Segment};
use crate::cache::{ImageSpan, SequenceState};
use crate::model::Model;
use crate::ops::RowPositions;
use crate::ModelError;

impl Model {
    /// Runs the `nx * ny` rows of `embd` (one image's embeddings, `n_embd` floats each, raster
    /// order) through the trunk after `state`'s committed rows and commits them. Logits as asked.
    pub fn forward_image(
        &self,
        embd: &[f32],
        nx: usize,
        ny: usize,
        state: &mut SequenceState,
        logit_rows: LogitRows,
        pool: &ThreadPool,
    ) -> Result<ForwardOutput, ModelError> {
        let e = self.config.n_embd;
        let n = nx * ny;
        if n == 0 || embd.len() != n * e {
            return Err(ModelError::ImageShape {
                found: embd.len(),
                nx,
                ny,
                n_embd: e,
            });
        }
        if state.pending_rows > 0 {
            return Err(ModelError::UncommittedVerify {
                pending: state.pending_rows,
            });
        }
        if state.layers.len() != self.layers.len() {
            return Err(ModelError::ForeignState {
                found: state.layers.len(),
                expected: self.layers.len(),
            });
        }
        state.check_room(n)?;
        let start = state.n_past;
        let positions = RowPositions::Image {
            p0: start - state.rope_shift(),
            nx,
        };
        let mut h = embd.to_vec();
        // The layers on the CPU (all of them, or those before the device's).
        for (il, layer) in self.layers[..self.host_layers()].iter().enumerate() {
            let mut segments = [Segment {
                rows: 0..n,
                start_pos: start,
                cache: &mut state.layers[il],
                verify: false,
                positions,
            }];
            layer.forward(&mut h, n, &mut segments, self.config.rms_eps, pool)?;
        }
        if let Some(d) = &self.device {
            let item = BatchItem {
                tokens: &[],
                state: &mut *state,
                logits: logit_rows,
                readback: Readback::Logits,
                verify: false,
            };
            let out = d.forward_image(self, item, &h, nx, pool)?;
            state.images.push(ImageSpan {
                start,
                n_tokens: n,
                n_pos: nx.max(ny),
            });
            return Ok(out);
        }
        let mut outs = finish_pass(
            &h,
            &self.output_norm,
            self.config.rms_eps,
            &[(0, n, logit_rows)],
            self.n_vocab,
            |picked, n_picked| {
                let mut logits = vec![0.0f32; n_picked * self.n_vocab];
                if n_picked > 0 {
                    self.lm_head.forward(picked, n_picked, &mut logits, pool)?;
                }
                Ok(logits)
            },
        )?;
        state.n_past += n;
        state.images.push(ImageSpan {
            start,
            n_tokens: n,
            n_pos: nx.max(ny),
        });
        Ok(outs.pop().expect("finish_pass returns one output per part"))
    }
}
