//! A device memory budget refuses what would not fit before anything is allocated, names it, and
//! takes back what is dropped.

use nextn_gpu::kv::{DeviceKv, KvElem};
use nextn_gpu::{Gpu, GpuError, OpenOptions};

fn device_with_budget(bytes: u64) -> Option<Gpu> {
    nextn_gpu::validation::test_device()?;
    Some(
        Gpu::open(&OpenOptions {
            name: std::env::var("NEXTN_TEST_DEVICE")
                .ok()
                .filter(|s| !s.is_empty()),
            validation: true,
            memory_budget: Some(bytes),
            pipeline_cache_dir: None,
        })
        .unwrap(),
    )
}

#[test]
fn a_kv_cache_over_the_budget_is_refused_and_dropped_ones_give_room_back() {
    let Some(gpu) = device_with_budget(1 << 20) else {
        return;
    };
    // 2 heads x 64 f16 x 2048 positions = 512 KiB a side: keys and values take the whole MiB.
    let kv = DeviceKv::new(&gpu, KvElem::F16, KvElem::F16, 2, 64, 2048).unwrap();
    assert_eq!(gpu.memory_budget(), (Some(1 << 20), 1 << 20));
    match DeviceKv::new(&gpu, KvElem::F16, KvElem::F16, 2, 64, 16) {
        Err(GpuError::OverBudget {
            what,
            bytes,
            used,
            budget,
        }) => {
            assert!(what.contains("KV cache of 16 positions"), "{what}");
            assert_eq!((bytes, used, budget), (8192, 1 << 20, 1 << 20));
        }
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("a cache over the budget was allocated"),
    }
    drop(kv);
    assert_eq!(gpu.memory_budget().1, 0);
    DeviceKv::new(&gpu, KvElem::F16, KvElem::F16, 2, 64, 16).unwrap();
    assert!(gpu.take_errors().is_empty());
}

#[test]
fn a_buffer_past_the_device_limit_is_an_error_naming_it() {
    let Some(gpu) = device_with_budget(u64::MAX) else {
        return;
    };
    match gpu.buffer("too-big", u64::MAX / 2) {
        Err(GpuError::BufferTooLarge { what, bytes, .. }) => {
            assert_eq!(what, "too-big");
            assert_eq!(bytes, u64::MAX / 2 + 1);
        }
        other => panic!("expected BufferTooLarge, got {:?}", other.map(|b| b.size())),
    }
    assert!(gpu.take_errors().is_empty());
}
