//! Metadata values exactly as typed in the file, so a file can be rewritten byte for byte.

/// GGUF metadata value type ids (the `u32` before each value).
pub mod type_id {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;
}

/// The name gguf-py and llama.cpp print for a value type id, or `None` for ids outside the format.
pub fn value_type_name(id: u32) -> Option<&'static str> {
    Some(match id {
        type_id::U8 => "u8",
        type_id::I8 => "i8",
        type_id::U16 => "u16",
        type_id::I16 => "i16",
        type_id::U32 => "u32",
        type_id::I32 => "i32",
        type_id::F32 => "f32",
        type_id::BOOL => "bool",
        type_id::STRING => "string",
        type_id::ARRAY => "array",
        type_id::U64 => "u64",
        type_id::I64 => "i64",
        type_id::F64 => "f64",
        _ => return None,
    })
}

/// One metadata value. The variant is the on-disk type, kept so that rewriting reproduces the file.
#[derive(Clone, Debug, PartialEq)]
pub enum MetadataValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(MetadataArray),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A typed array; every element has the same on-disk type. Nested arrays carry their own type each.
#[derive(Clone, Debug, PartialEq)]
pub enum MetadataArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<MetadataArray>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl MetadataValue {
    /// The on-disk value type id.
    pub fn type_id(&self) -> u32 {
        match self {
            MetadataValue::U8(_) => type_id::U8,
            MetadataValue::I8(_) => type_id::I8,
            MetadataValue::U16(_) => type_id::U16,
            MetadataValue::I16(_) => type_id::I16,
            MetadataValue::U32(_) => type_id::U32,
            MetadataValue::I32(_) => type_id::I32,
            MetadataValue::F32(_) => type_id::F32,
            MetadataValue::Bool(_) => type_id::BOOL,
            MetadataValue::String(_) => type_id::STRING,
            MetadataValue::Array(_) => type_id::ARRAY,
            MetadataValue::U64(_) => type_id::U64,
            MetadataValue::I64(_) => type_id::I64,
            MetadataValue::F64(_) => type_id::F64,
        }
    }

    /// `u8`, `i32`, `string`, `array`, ...
    pub fn type_name(&self) -> &'static str {
        value_type_name(self.type_id()).unwrap_or("?")
    }

    /// Any integer type, widened; `None` for non-integers.
    pub fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            MetadataValue::U8(v) => v.into(),
            MetadataValue::I8(v) => v.into(),
            MetadataValue::U16(v) => v.into(),
            MetadataValue::I16(v) => v.into(),
            MetadataValue::U32(v) => v.into(),
            MetadataValue::I32(v) => v.into(),
            MetadataValue::U64(v) => v.into(),
            MetadataValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// An integer of any type whose value fits in `u64`.
    pub fn as_u64(&self) -> Option<u64> {
        self.as_i128().and_then(|v| u64::try_from(v).ok())
    }

    /// An integer of any type whose value fits in `i64`.
    pub fn as_i64(&self) -> Option<i64> {
        self.as_i128().and_then(|v| i64::try_from(v).ok())
    }

    /// An integer of any type whose value fits in `u32`.
    pub fn as_u32(&self) -> Option<u32> {
        self.as_i128().and_then(|v| u32::try_from(v).ok())
    }

    /// An integer of any type whose value fits in `i32`.
    pub fn as_i32(&self) -> Option<i32> {
        self.as_i128().and_then(|v| i32::try_from(v).ok())
    }

    /// `F32`, or `F64` narrowed.
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            MetadataValue::F32(v) => Some(v),
            MetadataValue::F64(v) => Some(v as f32),
            _ => None,
        }
    }

    /// `F64`, or `F32` widened.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetadataValue::F32(v) => Some(v.into()),
            MetadataValue::F64(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetadataValue::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetadataValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&MetadataArray> {
        match self {
            MetadataValue::Array(a) => Some(a),
            _ => None,
        }
    }

    /// A short description for error messages: the type, plus the value for scalars.
    pub(crate) fn describe(&self) -> String {
        match self {
            MetadataValue::String(s) if s.len() <= 40 => format!("string {s:?}"),
            MetadataValue::String(s) => format!("string of {} bytes", s.len()),
            MetadataValue::Array(a) => {
                format!("array of {} {}", a.len(), a.element_type_name())
            }
            MetadataValue::U8(v) => format!("u8 {v}"),
            MetadataValue::I8(v) => format!("i8 {v}"),
            MetadataValue::U16(v) => format!("u16 {v}"),
            MetadataValue::I16(v) => format!("i16 {v}"),
            MetadataValue::U32(v) => format!("u32 {v}"),
            MetadataValue::I32(v) => format!("i32 {v}"),
            MetadataValue::U64(v) => format!("u64 {v}"),
            MetadataValue::I64(v) => format!("i64 {v}"),
            MetadataValue::F32(v) => format!("f32 {v}"),
            MetadataValue::F64(v) => format!("f64 {v}"),
            MetadataValue::Bool(v) => format!("bool {v}"),
        }
    }
}

macro_rules! int_vec {
    ($self:ident, $out:ty) => {{
        fn conv<T: Copy>(v: &[T]) -> Option<Vec<$out>>
        where
            $out: TryFrom<T>,
        {
            v.iter().map(|&x| <$out>::try_from(x).ok()).collect()
        }
        match $self {
            MetadataArray::U8(v) => conv(v),
            MetadataArray::I8(v) => conv(v),
            MetadataArray::U16(v) => conv(v),
            MetadataArray::I16(v) => conv(v),
            MetadataArray::U32(v) => conv(v),
            MetadataArray::I32(v) => conv(v),
            MetadataArray::U64(v) => conv(v),
            MetadataArray::I64(v) => conv(v),
            _ => None,
        }
    }};
}

impl MetadataArray {
    pub fn len(&self) -> usize {
        match self {
            MetadataArray::U8(v) => v.len(),
            MetadataArray::I8(v) => v.len(),
            MetadataArray::U16(v) => v.len(),
            MetadataArray::I16(v) => v.len(),
            MetadataArray::U32(v) => v.len(),
            MetadataArray::I32(v) => v.len(),
            MetadataArray::F32(v) => v.len(),
            MetadataArray::Bool(v) => v.len(),
            MetadataArray::String(v) => v.len(),
            MetadataArray::Array(v) => v.len(),
            MetadataArray::U64(v) => v.len(),
            MetadataArray::I64(v) => v.len(),
            MetadataArray::F64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The on-disk element type id.
    pub fn element_type_id(&self) -> u32 {
        match self {
            MetadataArray::U8(_) => type_id::U8,
            MetadataArray::I8(_) => type_id::I8,
            MetadataArray::U16(_) => type_id::U16,
            MetadataArray::I16(_) => type_id::I16,
            MetadataArray::U32(_) => type_id::U32,
            MetadataArray::I32(_) => type_id::I32,
            MetadataArray::F32(_) => type_id::F32,
            MetadataArray::Bool(_) => type_id::BOOL,
            MetadataArray::String(_) => type_id::STRING,
            MetadataArray::Array(_) => type_id::ARRAY,
            MetadataArray::U64(_) => type_id::U64,
            MetadataArray::I64(_) => type_id::I64,
            MetadataArray::F64(_) => type_id::F64,
        }
    }

    pub fn element_type_name(&self) -> &'static str {
        value_type_name(self.element_type_id()).unwrap_or("?")
    }

    /// Elements of any integer type, if every one fits in `u32`.
    pub fn as_u32_vec(&self) -> Option<Vec<u32>> {
        int_vec!(self, u32)
    }

    /// Elements of any integer type, if every one fits in `i32`.
    pub fn as_i32_vec(&self) -> Option<Vec<i32>> {
        int_vec!(self, i32)
    }

    /// Elements of any integer type, if every one fits in `u64`.
    pub fn as_u64_vec(&self) -> Option<Vec<u64>> {
        int_vec!(self, u64)
    }

    /// Elements of any integer type, if every one fits in `i64`.
    pub fn as_i64_vec(&self) -> Option<Vec<i64>> {
        int_vec!(self, i64)
    }

    /// `F32` elements, or `F64` ones narrowed.
    pub fn as_f32_vec(&self) -> Option<Vec<f32>> {
        match self {
            MetadataArray::F32(v) => Some(v.clone()),
            MetadataArray::F64(v) => Some(v.iter().map(|&x| x as f32).collect()),
            _ => None,
        }
    }

    pub fn as_bools(&self) -> Option<&[bool]> {
        match self {
            MetadataArray::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_strings(&self) -> Option<&[String]> {
        match self {
            MetadataArray::String(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_arrays(&self) -> Option<&[MetadataArray]> {
        match self {
            MetadataArray::Array(v) => Some(v),
            _ => None,
        }
    }
}

impl From<MetadataArray> for MetadataValue {
    fn from(a: MetadataArray) -> Self {
        MetadataValue::Array(a)
    }
}

macro_rules! from_scalar {
    ($($t:ty => $v:ident),*) => {$(
        impl From<$t> for MetadataValue {
            fn from(x: $t) -> Self { MetadataValue::$v(x) }
        }
        impl From<Vec<$t>> for MetadataArray {
            fn from(x: Vec<$t>) -> Self { MetadataArray::$v(x) }
        }
    )*};
}
from_scalar!(u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, f32 => F32,
    bool => Bool, String => String, u64 => U64, i64 => I64, f64 => F64);

impl From<&str> for MetadataValue {
    fn from(s: &str) -> Self {
        MetadataValue::String(s.to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_views_check_range() {
        assert_eq!(MetadataValue::I32(-1).as_u64(), None);
        assert_eq!(MetadataValue::I32(7).as_u32(), Some(7));
        assert_eq!(MetadataValue::U64(1 << 40).as_u32(), None);
        assert_eq!(MetadataValue::U64(u64::MAX).as_i64(), None);
        assert_eq!(MetadataValue::F32(1.0).as_u64(), None);
        assert_eq!(MetadataValue::Bool(true).as_u64(), None);
        assert_eq!(MetadataValue::F64(0.5).as_f32(), Some(0.5));
    }

    #[test]
    fn array_views() {
        let a = MetadataArray::I64(vec![1, 2, 3]);
        assert_eq!(a.as_u32_vec(), Some(vec![1, 2, 3]));
        assert_eq!(MetadataArray::I8(vec![-1]).as_u32_vec(), None);
        assert_eq!(MetadataArray::I8(vec![-1]).as_i32_vec(), Some(vec![-1]));
        assert_eq!(a.as_f32_vec(), None);
        assert_eq!(a.element_type_name(), "i64");
        let s = MetadataArray::String(vec!["x".into()]);
        assert_eq!(s.as_strings().map(|v| v.len()), Some(1));
        assert_eq!(MetadataValue::from(s).describe(), "array of 1 string");
    }
}
