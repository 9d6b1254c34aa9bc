//! The WGSL kernels and the host functions that record them.
//!
//! Conventions every kernel keeps:
//! - binding 0 is a uniform struct of u32 (and f32) parameters; bindings 1.. are storage buffers,
//!   bound whole; offsets into them are element offsets in the parameters;
//! - a kernel whose groups may exceed the per-dimension limit takes its group index as
//!   `wid.x + wid.y * nwg.x` ([`crate::groups_1d`]) and returns past the end;
//! - no kernel assumes a subgroup size: reductions go through workgroup memory, and the weight
//!   products end theirs within a subgroup ([`Kernel::source_for`], `lane_xor`) only where the
//!   device's subgroups were found at open to hold at least `LANES` consecutive invocations,
//!   adding the same pairs in the same order as the workgroup-memory tree (the same bits);
//! - a row's result never depends on the other rows of its dispatch: every output is reduced
//!   in a fixed order that depends only on its own shape.

/// `kernel!(ID, "name", "file.wgsl")`: a [`Kernel`] named as its entry point, its source one file
/// of `shaders/`.
macro_rules! kernel {
    ($id:ident, $name:literal, $file:literal) => {
        pub static $id: Kernel = Kernel {
            name: $name,
            source: include_str!(concat!("../shaders/", $file)),
            entry: $name,
        };
    };
}

pub mod argmax;
pub mod attention;
pub mod delta_net;
pub mod elementwise;
pub mod matvec;
pub mod norm;
pub mod vision;

/// One WGSL entry point.
#[derive(Debug)]
pub struct Kernel {
    pub name: &'static str,
    pub source: &'static str,
    pub entry: &'static str,
}

impl Kernel {
    /// The source a device compiles: a kernel that ends its reductions within subgroups (it calls
    /// `lane_xor`) gets `LANES` and `lane_xor` first: with `lanes` of 2 or more, lane `i ^ mask`'s
    /// value through `subgroupShuffleXor`, for a device whose every subgroup holds at least
    /// `lanes` consecutive invocations of a workgroup; with 1, no subgroup operation (the kernel
    /// then reduces through workgroup memory alone). Other kernels are their own source.
    pub fn source_for(&self, lanes: u32) -> std::borrow::Cow<'static, str> {
        if !self.source.contains("lane_xor(") {
            return self.source.into();
        }
        let prelude = if lanes >= 2 {
            format!(
                "const LANES: u32 = {lanes}u;\n\
                 fn lane_xor(v: f32, mask: u32) -> f32 {{ return subgroupShuffleXor(v, mask); }}\n"
            )
        } else {
            "const LANES: u32 = 1u;\nfn lane_xor(v: f32, mask: u32) -> f32 { return v; }\n"
                .to_string()
        };
        (prelude + self.source).into()
    }
}

/// Invocation `i` of a 128-wide workgroup writes its subgroup's size and its index within it, so
/// that a device is checked at open to lay its subgroups out as the products assume.
pub static SUBGROUP_PROBE: Kernel = Kernel {
    name: "subgroup_probe",
    source: include_str!("../shaders/subgroup_probe.wgsl"),
    entry: "subgroup_probe",
};

/// Every kernel, for the tests that validate and translate them all.
pub fn all() -> Vec<&'static Kernel> {
    let mut v: Vec<&'static Kernel> = Vec::new();
    v.extend(elementwise::KERNELS);
    v.extend(norm::KERNELS);
    v.extend(argmax::KERNELS);
    v.extend(delta_net::KERNELS);
    v.extend(attention::KERNELS);
    v.extend(vision::KERNELS);
    v.extend(matvec::kernels());
    v.push(&SUBGROUP_PROBE);
    v
}
