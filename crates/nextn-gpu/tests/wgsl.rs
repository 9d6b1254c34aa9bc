//! Every kernel parses and validates in naga and translates to SPIR-V (Vulkan) and MSL (Metal).

#[test]
fn every_kernel_validates_and_translates() {
    let kernels = nextn_gpu::kernels::all();
    assert!(!kernels.is_empty());
    let mut seen = std::collections::HashSet::new();
    let mut with_lanes = 0;
    for k in kernels {
        if !seen.insert(k.name) {
            continue;
        }
        // As a device without subgroups compiles it, and (where it reduces within subgroups) as
        // one with subgroups of 32.
        let plain = k.source_for(1);
        let wide = k.source_for(32);
        with_lanes += usize::from(plain != wide);
        for source in [plain, wide] {
            let module = naga::front::wgsl::parse_str(&source)
                .unwrap_or_else(|e| panic!("{}: {}", k.name, e.emit_to_string(&source)));
            let info = naga::valid::Validator::new(
                naga::valid::ValidationFlags::all(),
                naga::valid::Capabilities::all(),
            )
            .validate(&module)
            .unwrap_or_else(|e| panic!("{}: {e:?}", k.name));
            naga::back::spv::write_vec(&module, &info, &naga::back::spv::Options::default(), None)
                .unwrap_or_else(|e| panic!("{} to SPIR-V: {e}", k.name));
            let pipeline = naga::back::msl::PipelineOptions::default();
            naga::back::msl::write_string(
                &module,
                &info,
                &naga::back::msl::Options::default(),
                &pipeline,
            )
            .unwrap_or_else(|e| panic!("{} to MSL: {e}", k.name));
        }
    }
    // Every weight product ends its reductions within subgroups where it may.
    let products = seen
        .iter()
        .filter(|n| {
            ["matvec_", "matmul_", "swiglu_"]
                .iter()
                .any(|p| n.starts_with(p))
        })
        .count();
    assert!(
        products > 0 && with_lanes >= products,
        "{with_lanes} of {products}"
    );
}

/// The int8 kernels use the SPIR-V integer dot product where the device declares it (what
/// wgpu does on Vulkan 1.3 and with VK_KHR_shader_integer_dot_product) and translate without
/// it too (naga then writes the bytes out one by one).
#[test]
fn int8_kernels_use_the_integer_dot_product_where_declared() {
    use naga::back::spv::{Capability, Options};
    const OP_SDOT: u32 = 4450;
    let has_sdot = |words: &[u32]| words.iter().any(|w| w & 0xffff == OP_SDOT && w >> 16 == 6);
    let mut seen = 0;
    for k in nextn_gpu::kernels::all() {
        if !k.source.contains("dot4I8Packed") {
            continue;
        }
        seen += 1;
        let module = naga::front::wgsl::parse_str(&k.source_for(1)).unwrap();
        let info = naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::all(),
        )
        .validate(&module)
        .unwrap();
        let base = [
            Capability::Shader,
            Capability::Matrix,
            Capability::StorageBuffer16BitAccess,
        ];
        let with: naga::FastHashSet<Capability> = base
            .into_iter()
            .chain([
                Capability::DotProduct,
                Capability::DotProductInput4x8BitPacked,
            ])
            .collect();
        let without: naga::FastHashSet<Capability> = base.into_iter().collect();
        let spv = |caps| {
            let opts = Options {
                capabilities: Some(caps),
                ..Options::default()
            };
            naga::back::spv::write_vec(&module, &info, &opts, None)
                .unwrap_or_else(|e| panic!("{}: {e}", k.name))
        };
        assert!(has_sdot(&spv(with)), "{}: no OpSDot", k.name);
        assert!(!has_sdot(&spv(without)), "{}: OpSDot undeclared", k.name);
    }
    // Six types, each 8 mat-vec modules, a tile and the experts, and the 8 modules and the
    // tile of a gate|up pair.
    assert_eq!(seen, 6 * 19);
}
