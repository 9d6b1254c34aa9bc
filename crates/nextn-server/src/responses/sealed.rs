//! Reasoning given back as Responses' `encrypted_content`: sealed with ChaCha20-Poly1305 under a
//! key drawn from the OS random source when the server starts, so only this server (while it
//! runs) can open it, and content a client wrote or altered does not open. Ids of responses come
//! from the same random source, so one cannot be guessed from another.

use base64::Engine as _;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, CHACHA20_POLY1305, NONCE_LEN};
use ring::rand::{SecureRandom, SystemRandom};

/// What sealed text starts with: the format, so another server's content is told apart.
const PREFIX: &str = "nextn-sealed-v1.";

/// Why the server could not set up its sealing key.
#[derive(Debug, thiserror::Error)]
#[error("the OS random source failed while drawing the key that seals reasoning")]
pub struct SealerError;

pub(crate) struct Sealer {
    key: LessSafeKey,
    random: SystemRandom,
}

impl Sealer {
    pub fn new() -> Result<Self, SealerError> {
        let random = SystemRandom::new();
        let mut key = [0u8; 32];
        random.fill(&mut key).map_err(|_| SealerError)?;
        let key = UnboundKey::new(&CHACHA20_POLY1305, &key).map_err(|_| SealerError)?;
        Ok(Sealer {
            key: LessSafeKey::new(key),
            random,
        })
    }

    /// `text` sealed: the prefix, then base64 of nonce, ciphertext and tag.
    pub fn seal(&self, text: &str) -> Option<String> {
        let mut nonce = [0u8; NONCE_LEN];
        self.random.fill(&mut nonce).ok()?;
        let mut data = text.as_bytes().to_vec();
        self.key
            .seal_in_place_append_tag(Nonce::assume_unique_for_key(nonce), Aad::empty(), &mut data)
            .ok()?;
        let mut out = nonce.to_vec();
        out.extend_from_slice(&data);
        Some(format!(
            "{PREFIX}{}",
            base64::engine::general_purpose::STANDARD.encode(out)
        ))
    }

    /// The text `sealed` holds, if this server sealed it and nobody changed it.
    pub fn open(&self, sealed: &str) -> Option<String> {
        let b64 = sealed.strip_prefix(PREFIX)?;
        let mut data = base64::engine::general_purpose::STANDARD.decode(b64).ok()?;
        if data.len() < NONCE_LEN {
            return None;
        }
        let nonce = Nonce::try_assume_unique_for_key(&data[..NONCE_LEN]).ok()?;
        let plain = self
            .key
            .open_in_place(nonce, Aad::empty(), &mut data[NONCE_LEN..])
            .ok()?;
        String::from_utf8(plain.to_vec()).ok()
    }

    /// 128 random bits as 32 hex digits, for an id nobody can guess from another.
    pub fn random_hex(&self) -> String {
        let mut b = [0u8; 16];
        if self.random.fill(&mut b).is_err() {
            // The source failed after it worked at start-up: fall back to the process's own
            // unique stream rather than fail the response.
            b[..8].copy_from_slice(&crate::request::fresh_seed().to_le_bytes());
            b[8..].copy_from_slice(&crate::request::fresh_seed().to_le_bytes());
        }
        b.iter().map(|x| format!("{x:02x}")).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sealed_text_opens_here_only_and_unaltered() {
        let a = Sealer::new().unwrap();
        let s = a.seal("step by step").unwrap();
        assert!(!s.contains("step"));
        assert_eq!(a.open(&s).as_deref(), Some("step by step"));
        // Another server (or this one after a restart) cannot open it.
        assert_eq!(Sealer::new().unwrap().open(&s), None);
        // A flipped character, plain base64 and the old unauthenticated format do not open.
        let mut bytes = s.clone().into_bytes();
        let last = bytes.len() - 3;
        bytes[last] = if bytes[last] == b'A' { b'B' } else { b'A' };
        assert_eq!(a.open(&String::from_utf8(bytes).unwrap()), None);
        assert_eq!(a.open("c3RlcA=="), None);
        assert_eq!(a.open(&format!("{PREFIX}c3RlcA==")), None);
        assert_ne!(a.random_hex(), a.random_hex());
        assert_eq!(a.random_hex().len(), 32);
    }
}
