//! Incremental detokenization: byte-level tokens often end in the middle of a UTF-8 character.

use super::Tokenizer;

/// Turns a stream of token ids into text pieces that are always whole UTF-8.
///
/// Bytes of an incomplete character are held back until the next token completes it. Bytes that can
/// never form a character become U+FFFD, one per maximal invalid sequence, so the concatenation of
/// everything returned by [`push`](Self::push) and [`flush`](Self::flush) equals
/// [`Tokenizer::decode`] of the whole sequence.
pub struct StreamDecoder<'t> {
    tokenizer: &'t Tokenizer,
    pending: Vec<u8>,
}

impl<'t> StreamDecoder<'t> {
    pub fn new(tokenizer: &'t Tokenizer) -> Self {
        StreamDecoder {
            tokenizer,
            pending: Vec::new(),
        }
    }

    /// Adds one token and returns the text it completes (possibly empty).
    pub fn push(&mut self, id: u32) -> String {
        let tokenizer = self.tokenizer;
        self.push_bytes(tokenizer.token_bytes(id))
    }

    /// Adds raw bytes and returns the text they complete (possibly empty).
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut text = String::new();
        let mut consumed = 0;
        while consumed < self.pending.len() {
            match std::str::from_utf8(&self.pending[consumed..]) {
                Ok(rest) => {
                    text.push_str(rest);
                    consumed = self.pending.len();
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The prefix up to `valid_up_to` is valid UTF-8 by definition.
                    text.push_str(
                        std::str::from_utf8(&self.pending[consumed..consumed + valid])
                            .unwrap_or(""),
                    );
                    consumed += valid;
                    match e.error_len() {
                        Some(invalid) => {
                            text.push(char::REPLACEMENT_CHARACTER);
                            consumed += invalid;
                        }
                        // An incomplete character at the end: wait for more bytes.
                        None => break,
                    }
                }
            }
        }
        self.pending.drain(..consumed);
        text
    }

    /// Bytes held back because they end in an incomplete character.
    pub fn pending_bytes(&self) -> &[u8] {
        &self.pending
    }

    /// Ends the stream: whatever is still held back is returned, an incomplete character as U+FFFD.
    pub fn flush(&mut self) -> String {
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        text
    }
}
