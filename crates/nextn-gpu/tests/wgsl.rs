//! Every kernel parses and validates in naga and translates to SPIR-V (Vulkan) and MSL (Metal).

#[test]
fn every_kernel_validates_and_translates() {
    let kernels = nextn_gpu::kernels::all();
    assert!(!kernels.is_empty());
    let mut seen = std::collections::HashSet::new();
    for k in kernels {
        if !seen.insert(k.name) {
            continue;
        }
        let module = naga::front::wgsl::parse_str(k.source)
            .unwrap_or_else(|e| panic!("{}: {}", k.name, e.emit_to_string(k.source)));
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
