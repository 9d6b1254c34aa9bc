//! Where each part of a model runs when a device is used: the trunk's first layers on the CPU and
//! the rest on the device, as llama.cpp's `-ngl N` splits a model.
//!
//! A pass over a split model crosses once: the CPU layers run over the rows, their hidden rows go
//! up in one upload, the device layers, the final norm and the LM head run in the device's one
//! submission. Caches follow their layers (host caches for the CPU layers, device caches for the
//! others), so a sequence's state is a mix that the prefix cache, slot files and rollback handle
//! layer by layer.

use nextn_gguf::GgufFile;

use crate::cache::KvType;
use crate::config::LayerKind;
use crate::Qwen35Config;

/// The layer counts a placement needs: trunk layers, and whether the file has a NextN block after
/// them (`block_count` = trunk layers + NextN blocks, as llama.cpp counts the file's layers).
#[derive(Clone, Copy, Debug)]
pub struct Blocks {
    pub trunk: usize,
    pub head: bool,
}

impl Blocks {
    pub fn of(cfg: &Qwen35Config) -> Blocks {
        Blocks {
            trunk: cfg.n_layer,
            head: cfg.nextn_block().is_some(),
        }
    }

    fn all(&self) -> usize {
        self.trunk + usize::from(self.head)
    }
}

/// The layers a device holds: trunk layers `first_device_layer..`, the final norm and the LM head,
/// and the NextN head's block when `head_on_device`. Everything before `first_device_layer` runs on
/// the CPU, and so do the routed experts of the device's layers marked in `host_experts`
/// (llama.cpp's `--cpu-moe`, `--n-cpu-moe`, `-ot …exps=CPU`): there the router and the shared
/// expert run on the device, the rows and their experts cross to the CPU and the sum comes back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    pub first_device_layer: usize,
    pub head_on_device: bool,
    /// Per file block (the trunk's layers, then the NextN block): its routed experts on the CPU
    /// (missing entries: no).
    pub host_experts: Vec<bool>,
}

impl Placement {
    /// The whole model on the device.
    pub fn all_on_device() -> Placement {
        Placement {
            first_device_layer: 0,
            head_on_device: true,
            host_experts: Vec::new(),
        }
    }

    /// llama.cpp's `-ngl n` (n ≥ 1) for a model with `cfg`'s layers. llama.cpp counts the
    /// file's blocks, the trunk's layers then the NextN block (`block_count`), and the output
    /// after them: the last `n` of those go to the device, so `n = 1` is the output alone, `n = 2`
    /// adds the NextN block (on a file with one), and `block_count + 1` or more is everything.
    pub fn from_gpu_layers(n: usize, b: Blocks) -> Placement {
        // llama.cpp's `i_gpu_start`: the first block on the device.
        let first_block = (b.all() + 1).saturating_sub(n);
        Placement {
            first_device_layer: first_block.min(b.trunk),
            head_on_device: b.head && b.trunk >= first_block,
            host_experts: Vec::new(),
        }
    }

    /// Placement with the trunk's layers `first..` on the device and the head there too.
    pub fn from_first_device_layer(first: usize, b: Blocks) -> Placement {
        Placement {
            first_device_layer: first.min(b.trunk),
            head_on_device: true,
            host_experts: Vec::new(),
        }
    }

    /// This placement with the routed experts of blocks `layers` on the CPU (the NextN block is
    /// the one after the trunk's, as llama.cpp numbers the file's blocks).
    pub fn with_host_experts(mut self, layers: impl IntoIterator<Item = usize>) -> Placement {
        for il in layers {
            if self.host_experts.len() <= il {
                self.host_experts.resize(il + 1, false);
            }
            self.host_experts[il] = true;
        }
        self
    }

    /// Whether a device layer `il` has its routed experts on the CPU.
    pub fn experts_on_host(&self, il: usize) -> bool {
        il >= self.first_device_layer && self.host_experts.get(il).copied().unwrap_or(false)
    }

    /// Whether tensor `name` is used on the CPU: every tensor of a CPU block, and the routed
    /// experts' tensors (`ffn_*_exps`) of a device layer whose experts run on the CPU.
    pub fn tensor_on_host(&self, name: &str, b: Blocks) -> bool {
        let Some(il) = block_of(name) else {
            return false;
        };
        self.block_on_host(il, b) || (is_routed_expert(name) && self.experts_on_host(il))
    }

    /// llama.cpp's `-ngl` count for this placement on a model with `cfg`'s layers.
    pub fn gpu_layers(&self, b: Blocks) -> usize {
        let trunk = b.trunk - self.first_device_layer.min(b.trunk);
        trunk + usize::from(b.head && self.head_on_device) + 1
    }

    /// Whether block `il` of the file (a trunk layer, or the NextN block) runs on the CPU.
    pub fn block_on_host(&self, il: usize, b: Blocks) -> bool {
        if il < b.trunk {
            il < self.first_device_layer
        } else {
            !self.head_on_device
        }
    }

    /// One line for the load message: which layers run where.
    pub fn describe(&self, b: Blocks, device: &str) -> String {
        let first = self.first_device_layer.min(b.trunk);
        let span = |a: usize, b: usize| match b - a {
            0 => None,
            1 => Some(format!("layer {a}")),
            _ => Some(format!("layers {a}-{}", b - 1)),
        };
        let head = b.head.then_some("the NextN head");
        let mut on_host: Vec<String> = span(0, first).into_iter().collect();
        let mut on_device: Vec<String> = span(first, b.trunk).into_iter().collect();
        on_device.push("the output".into());
        match (head, self.head_on_device) {
            (Some(h), true) => on_device.push(h.into()),
            (Some(h), false) => on_host.push(h.into()),
            (None, _) => {}
        }
        let experts: Vec<usize> = (first..b.trunk)
            .filter(|&il| self.experts_on_host(il))
            .collect();
        let head_experts = b.head && self.head_on_device && self.experts_on_host(b.trunk);
        if !experts.is_empty() {
            let noun = if experts.len() == 1 {
                "layer"
            } else {
                "layers"
            };
            let head = if head_experts {
                " and the NextN head"
            } else {
                ""
            };
            on_host.push(format!(
                "the routed experts of {noun} {}{head}",
                spans(&experts)
            ));
        } else if head_experts {
            on_host.push("the routed experts of the NextN head".into());
        }
        let list = |v: &[String]| v.join(", ");
        if on_host.is_empty() {
            format!("all on {device}")
        } else {
            format!(
                "{} on the CPU; {} on {device}",
                list(&on_host),
                list(&on_device)
            )
        }
    }
}

/// The block `N` of a tensor named `blk.N.…`.
pub fn block_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// Whether tensor `name` is one of a layer's routed experts (`ffn_gate_exps`, `ffn_up_exps`,
/// `ffn_down_exps`, a fused `ffn_gate_up_exps`, their per-expert scales).
pub fn is_routed_expert(name: &str) -> bool {
    name.split('.')
        .nth(2)
        .is_some_and(|t| t.starts_with("ffn_") && t.ends_with("_exps"))
}

/// `[0, 1, 2, 5]` as `0-2, 5`.
fn spans(layers: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < layers.len() {
        let mut j = i;
        while j + 1 < layers.len() && layers[j + 1] == layers[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            layers[i].to_string()
        } else {
            format!("{}-{}", layers[i], layers[j])
        });
        i = j + 1;
    }
    out.join(", ")
}

/// The sequence a device holds beside the weights: one of `n_ctx` positions with `k_type` /
/// `v_type` attention caches, and the NextN head's cache when it is `drafting`.
#[derive(Clone, Copy, Debug)]
pub struct SequenceShape {
    pub n_ctx: usize,
    pub k_type: KvType,
    pub v_type: KvType,
    pub drafting: bool,
}

/// What each part of a model takes on a device, in bytes, estimated before anything is uploaded:
/// its tensors as the file stores them, and the caches of one sequence at the requested context.
#[derive(Clone, Debug)]
pub struct DeviceCosts {
    /// Per file block (the trunk's layers, then the NextN block): weights and caches.
    pub blocks: Vec<u64>,
    /// Per file block: the part of `blocks` that is routed experts.
    pub experts: Vec<u64>,
    /// The final norm and the LM head.
    pub output: u64,
}

impl DeviceCosts {
    /// The estimate for `file` with `cfg` and one sequence of `seq`'s shape.
    pub fn estimate(file: &GgufFile, cfg: &Qwen35Config, seq: SequenceShape) -> DeviceCosts {
        let SequenceShape {
            n_ctx,
            k_type,
            v_type,
            drafting,
        } = seq;
        let blocks = Blocks::of(cfg);
        let mut weights = vec![0u64; blocks.all()];
        let mut experts = vec![0u64; blocks.all()];
        let mut output = 0u64;
        for t in file.tensors() {
            match block_of(&t.name) {
                Some(il) if il < weights.len() => {
                    weights[il] += t.n_bytes;
                    if is_routed_expert(&t.name) {
                        experts[il] += t.n_bytes;
                    }
                }
                Some(_) => {}
                None if t.name.starts_with("output") => output += t.n_bytes,
                None => {}
            }
        }
        if file.tensor("output.weight").is_none() {
            // Tied: the LM head is the embedding table.
            output += file.tensor("token_embd.weight").map_or(0, |t| t.n_bytes);
        }
        let kv = |il: usize| {
            let width = cfg.n_head_kv.get(il).copied().unwrap_or(0) * cfg.head_dim;
            ((k_type.row_bytes(width) + v_type.row_bytes(width)) * n_ctx) as u64
        };
        // A delta-net layer keeps two copies of its recurrent state and of its conv window.
        let conv_dim = 2 * cfg.ssm_k_heads * cfg.ssm_head_dim + cfg.ssm_inner;
        let delta = (2 * cfg.ssm_v_heads * cfg.ssm_head_dim * cfg.ssm_head_dim
            + 2 * cfg.conv_kernel.saturating_sub(1) * conv_dim) as u64
            * 4;
        for (il, w) in weights.iter_mut().enumerate() {
            *w += match cfg.layer_kinds.get(il) {
                _ if il >= blocks.trunk && drafting => kv(il),
                _ if il >= blocks.trunk => 0,
                Some(LayerKind::FullAttention) => kv(il),
                Some(_) => delta,
                None => 0,
            };
        }
        DeviceCosts {
            blocks: weights,
            experts,
            output,
        }
    }

    /// What `placement` puts on the device.
    pub fn on_device(&self, placement: &Placement, b: Blocks) -> u64 {
        let blocks: u64 = self
            .blocks
            .iter()
            .enumerate()
            .filter(|(il, _)| !placement.block_on_host(*il, b))
            .map(|(il, &c)| {
                if placement.experts_on_host(il) {
                    c - self.experts.get(il).copied().unwrap_or(0).min(c)
                } else {
                    c
                }
            })
            .sum();
        self.output + blocks
    }
}

impl Placement {
    /// llama.cpp's automatic fit: the largest `-ngl` (the output first, then the NextN block, then
    /// the trunk's layers from the last) whose parts fit in `room` bytes; `None` when not even the
    /// output does.
    ///
    /// On a MoE model the routed experts go first, as llama.cpp fits such a model: the experts of
    /// the first layers move to the CPU, one layer at a time, until the rest fits (attention, the
    /// router, the shared expert and the caches stay on the device); with every layer's experts
    /// on the CPU and still too much, whole layers follow.
    ///
    /// `flagged`: trunk layers whose experts flags put on the CPU already (`--cpu-moe`,
    /// `--n-cpu-moe`, `-ot`); then only whole layers move.
    pub fn fit(costs: &DeviceCosts, b: Blocks, room: u64, flagged: &[usize]) -> Option<Placement> {
        let start = Placement::all_on_device().with_host_experts(flagged.iter().copied());
        if costs.on_device(&start, b) <= room {
            return Some(start);
        }
        let has_experts = costs.experts.iter().take(b.trunk).any(|&x| x > 0);
        if has_experts && flagged.is_empty() {
            if let Some(p) = (1..=b.trunk)
                .map(|k| Placement::all_on_device().with_host_experts(0..k))
                .find(|p| costs.on_device(p, b) <= room)
            {
                return Some(p);
            }
        }
        let experts_out: Vec<usize> = if !flagged.is_empty() {
            flagged.to_vec()
        } else if has_experts {
            (0..b.trunk).collect()
        } else {
            Vec::new()
        };
        (1..=b.all() + 1)
            .rev()
            .map(|n| {
                Placement::from_gpu_layers(n, b).with_host_experts(experts_out.iter().copied())
            })
            .find(|p| costs.on_device(p, b) <= room)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(first_device_layer: usize, head_on_device: bool) -> Placement {
        Placement {
            first_device_layer,
            head_on_device,
            host_experts: Vec::new(),
        }
    }

    /// llama.cpp's counting: the output first, then the NextN block, then the trunk from its end.
    #[test]
    fn gpu_layers_count_as_llama_cpp_counts_them() {
        let b = Blocks {
            trunk: 8,
            head: true,
        };
        let p = |n| Placement::from_gpu_layers(n, b);
        assert_eq!(p(1), at(8, false));
        assert_eq!(p(2), at(8, true));
        assert_eq!(p(3), at(7, true));
        assert_eq!(p(10), Placement::all_on_device());
        assert_eq!(p(99), Placement::all_on_device());
        for n in 1..=10 {
            assert_eq!(p(n).gpu_layers(b), n, "-ngl {n}");
        }
        let plain = Blocks {
            trunk: 8,
            head: false,
        };
        assert_eq!(Placement::from_gpu_layers(2, plain), at(7, false));
        assert_eq!(Placement::from_gpu_layers(9, plain).first_device_layer, 0);
        assert!(p(3).block_on_host(6, b) && !p(3).block_on_host(7, b) && !p(3).block_on_host(8, b));
        assert!(p(1).block_on_host(8, b));
    }

    #[test]
    fn the_load_line_names_each_side() {
        let b = Blocks {
            trunk: 8,
            head: true,
        };
        assert_eq!(
            Placement::from_gpu_layers(5, b).describe(b, "Vulkan0"),
            "layers 0-4 on the CPU; layers 5-7, the output, the NextN head on Vulkan0"
        );
        assert_eq!(
            Placement::from_gpu_layers(1, b).describe(b, "Vulkan0"),
            "layers 0-7, the NextN head on the CPU; the output on Vulkan0"
        );
        assert_eq!(
            Placement::all_on_device().describe(b, "Vulkan0"),
            "all on Vulkan0"
        );
        // The NextN block is block 8: `--cpu-moe` takes its experts with the trunk's.
        let all = Placement::all_on_device().with_host_experts(0..9);
        assert!(all.experts_on_host(8));
        assert_eq!(
            all.describe(b, "Vulkan0"),
            "the routed experts of layers 0-7 and the NextN head on the CPU; \
             layers 0-7, the output, the NextN head on Vulkan0"
        );
        assert_eq!(
            Placement::all_on_device()
                .with_host_experts([8])
                .describe(b, "Vulkan0"),
            "the routed experts of the NextN head on the CPU; \
             layers 0-7, the output, the NextN head on Vulkan0"
        );
        assert!(all.tensor_on_host("blk.8.ffn_up_exps.weight", b));
        assert!(!all.tensor_on_host("blk.8.attn_q.weight", b));
    }

    #[test]
    fn fitting_gives_the_device_the_output_then_the_head_then_layers_from_the_end() {
        let b = Blocks {
            trunk: 4,
            head: true,
        };
        let costs = DeviceCosts {
            blocks: vec![10, 10, 10, 10, 7],
            experts: vec![0; 5],
            output: 5,
        };
        let fit = |room| Placement::fit(&costs, b, room, &[]);
        assert_eq!(fit(1000), Some(Placement::all_on_device()));
        assert_eq!(fit(52), Some(Placement::all_on_device()));
        assert_eq!(fit(51), Some(at(1, true)));
        assert_eq!(fit(41), Some(at(2, true)));
        assert_eq!(fit(12), Some(at(4, true)));
        assert_eq!(fit(11), Some(at(4, false)));
        assert_eq!(fit(4), None);
    }

    /// Four trunk layers of 10 (8 of them routed experts), a head of 7, an output of 5.
    fn moe_costs() -> DeviceCosts {
        DeviceCosts {
            blocks: vec![10, 10, 10, 10, 7],
            experts: vec![8, 8, 8, 8, 0],
            output: 5,
        }
    }

    /// A MoE model gives up its routed experts first, from the first layer on, then whole layers.
    #[test]
    fn fitting_a_moe_model_moves_experts_first() {
        let b = Blocks {
            trunk: 4,
            head: true,
        };
        let costs = moe_costs();
        let fit = |room| Placement::fit(&costs, b, room, &[]);
        assert_eq!(fit(52), Some(Placement::all_on_device()));
        let experts = |k| Placement::all_on_device().with_host_experts(0..k);
        assert_eq!(fit(51), Some(experts(1)));
        assert_eq!(fit(36), Some(experts(2)));
        assert_eq!(fit(20), Some(experts(4)));
        assert_eq!(
            fit(19),
            Some(Placement::from_gpu_layers(5, b).with_host_experts(0..4))
        );
        assert!(experts(2).experts_on_host(1) && !experts(2).experts_on_host(2));
        assert_eq!(
            experts(2).describe(b, "Vulkan0"),
            "the routed experts of layers 0-1 on the CPU; layers 0-3, the output, the NextN head on Vulkan0"
        );
        assert!(experts(2).tensor_on_host("blk.1.ffn_down_exps.weight", b));
        assert!(!experts(2).tensor_on_host("blk.1.ffn_gate_inp.weight", b));
        assert!(!experts(2).tensor_on_host("blk.2.ffn_up_exps.weight", b));
        assert!(!experts(2).tensor_on_host("output.weight", b));
    }

    /// Experts placed by flag stay as the flags put them; fitting then moves whole layers.
    #[test]
    fn fitting_keeps_the_experts_the_flags_placed() {
        let b = Blocks {
            trunk: 4,
            head: true,
        };
        let costs = moe_costs();
        let two = Placement::all_on_device().with_host_experts(0..2);
        assert_eq!(Placement::fit(&costs, b, 36, &[0, 1]), Some(two));
        assert_eq!(
            Placement::fit(&costs, b, 35, &[0, 1]),
            Some(Placement::from_gpu_layers(5, b).with_host_experts(0..2))
        );
    }
}
