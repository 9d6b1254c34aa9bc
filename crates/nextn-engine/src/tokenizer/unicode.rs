//! Character classes for the pre-tokenizer and the GPT-2 byte <-> printable-char mapping.
//!
//! llama.cpp runs the Qwen split regex with `std::regex` over a "collapsed" copy of the text in which
//! every non-ASCII code point is replaced by one byte standing for its class (whitespace first, then
//! letter / number / mark / punctuation / symbol / other). ASCII stays as is, so for ASCII `\s` is C's
//! `isspace`, `\p{L}` is `[A-Za-z]` and `\p{N}` is `[0-9]`. [`classify`] reproduces exactly that
//! classification, which is all the split regex can observe.

use unicode_general_category::{get_general_category, GeneralCategory};

/// What the split regex can tell apart about one code point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CharClass {
    /// `\s`: ASCII `\t \n \v \f \r` and space, or a non-ASCII `White_Space` code point.
    Whitespace,
    /// `\p{L}`.
    Letter,
    /// `\p{N}`.
    Number,
    /// `\p{M}` (combining marks).
    Mark,
    /// Anything else: punctuation, symbols, controls, format characters, unassigned.
    Other,
}

/// Non-ASCII code points with the Unicode `White_Space` property (llama.cpp's whitespace set).
fn is_non_ascii_whitespace(c: char) -> bool {
    matches!(
        c as u32,
        0x85 | 0xA0 | 0x1680 | 0x2000..=0x200A | 0x2028 | 0x2029 | 0x202F | 0x205F | 0x3000
    )
}

pub(crate) fn classify(c: char) -> CharClass {
    if c.is_ascii() {
        return match c as u8 {
            b'\t' | b'\n' | 0x0B | 0x0C | b'\r' | b' ' => CharClass::Whitespace,
            b'A'..=b'Z' | b'a'..=b'z' => CharClass::Letter,
            b'0'..=b'9' => CharClass::Number,
            _ => CharClass::Other,
        };
    }
    if is_non_ascii_whitespace(c) {
        return CharClass::Whitespace;
    }
    use GeneralCategory as G;
    match get_general_category(c) {
        G::UppercaseLetter
        | G::LowercaseLetter
        | G::TitlecaseLetter
        | G::ModifierLetter
        | G::OtherLetter => CharClass::Letter,
        G::DecimalNumber | G::LetterNumber | G::OtherNumber => CharClass::Number,
        G::NonspacingMark | G::SpacingMark | G::EnclosingMark => CharClass::Mark,
        _ => CharClass::Other,
    }
}

/// GPT-2's reversible byte -> printable char table: printable Latin-1 bytes map to themselves, the
/// other 68 bytes (controls, space, DEL, NBSP, soft hyphen...) to U+0100.. in byte order.
pub(crate) fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next_shifted = 0u32;
    for byte in 0u32..256 {
        let printable = (0x21..=0x7E).contains(&byte)
            || (0xA1..=0xAC).contains(&byte)
            || (0xAE..=0xFF).contains(&byte);
        let code = if printable {
            byte
        } else {
            next_shifted += 1;
            255 + next_shifted
        };
        // Every code here is < 0x144, far from the surrogate range.
        table[byte as usize] = char::from_u32(code).unwrap_or('\u{FFFD}');
    }
    table
}

/// Inverse of [`byte_to_char_table`] indexed by code point (all mapped code points are < 0x144).
pub(crate) fn char_to_byte_table(forward: &[char; 256]) -> Vec<Option<u8>> {
    let mut inverse = vec![None; 0x144];
    for (byte, &c) in forward.iter().enumerate() {
        inverse[c as usize] = Some(byte as u8);
    }
    inverse
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_matches_gpt2_layout() {
        let t = byte_to_char_table();
        assert_eq!(t[b'!' as usize], '!');
        assert_eq!(t[b' ' as usize], '\u{120}'); // 'Ġ'
        assert_eq!(t[b'\n' as usize], '\u{10A}'); // 'Ċ'
        assert_eq!(t[0], '\u{100}');
        assert_eq!(t[0xAD], '\u{143}');
        let inv = char_to_byte_table(&t);
        for b in 0..=255u8 {
            assert_eq!(inv[t[b as usize] as usize], Some(b));
        }
    }

    #[test]
    fn classes_follow_llama_cpp_collapse() {
        assert_eq!(classify('a'), CharClass::Letter);
        assert_eq!(classify('é'), CharClass::Letter);
        assert_eq!(classify('中'), CharClass::Letter);
        assert_eq!(classify('\u{301}'), CharClass::Mark);
        assert_eq!(classify('²'), CharClass::Number);
        assert_eq!(classify('٣'), CharClass::Number);
        assert_eq!(classify('\u{A0}'), CharClass::Whitespace);
        assert_eq!(classify('\u{3000}'), CharClass::Whitespace);
        assert_eq!(classify('\u{0B}'), CharClass::Whitespace);
        // Zero-width space is a format character, not whitespace.
        assert_eq!(classify('\u{200B}'), CharClass::Other);
        // ASCII information separators are not `isspace` in the C locale.
        assert_eq!(classify('\u{1F}'), CharClass::Other);
        assert_eq!(classify('_'), CharClass::Other);
        assert_eq!(classify('😀'), CharClass::Other);
    }
}
