"""Writes the small gguf-py fixtures in this directory (run once; tests only read the outputs).

gguf-py is an independent writer, so these files check that our reader accepts what it produces
and that our writer reproduces it byte for byte.
"""
import os
import numpy as np
import gguf

here = os.path.dirname(os.path.abspath(__file__))


def add_everything(w: gguf.GGUFWriter) -> None:
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1.5)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", -2.25)
    w.add_array("t.arr.i32", [1, -2, 3])
    w.add_array("t.arr.f32", [0.5, -1.0])
    w.add_array("t.arr.str", ["a", "", "ünï"])
    w.add_array("t.arr.bool", [True, False, True])
    w.add_array("t.arr.empty", [])
    w.add_array("t.arr.nested", [[1, 2], [3]])


def main() -> None:
    w = gguf.GGUFWriter(os.path.join(here, "gguf_py_all_types.gguf"), "testarch")
    w.add_custom_alignment(64)
    add_everything(w)
    w.add_tensor("f32.a", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("f16.b", np.arange(5, dtype=np.float16))
    w.add_tensor("i8.c", np.arange(7, dtype=np.int8))
    q8 = np.zeros((2, 34), dtype=np.uint8)  # two rows of one Q8_0 block each
    q8[:, 2:] = np.arange(32, dtype=np.uint8)
    w.add_tensor("q8.d", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    w = gguf.GGUFWriter(os.path.join(here, "gguf_py_split.gguf"), "testarch", split_max_tensors=2)
    w.add_string("general.name", "split fixture")
    for i in range(5):
        w.add_tensor(f"t{i}", np.full((i + 1, 3), i, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


main()
