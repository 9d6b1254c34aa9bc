//! The WGSL kernels and the host functions that record them.
//!
//! Conventions every kernel keeps:
//! - binding 0 is a uniform struct of u32 (and f32) parameters; bindings 1.. are storage buffers,
//!   bound whole; offsets into them are element offsets in the parameters;
//! - a kernel whose groups may exceed the per-dimension limit takes its group index as
//!   `wid.x + wid.y * nwg.x` ([`crate::groups_1d`]) and returns past the end;
//! - no kernel assumes a subgroup size: reductions go through workgroup memory;
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
    v
}
