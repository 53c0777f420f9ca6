//! WireGuard keys as values: base64 parsing, and a secret type whose Debug never shows the bytes.

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use std::fmt;

/// A Curve25519 public key (32 bytes), displayed as base64 like `wg` does.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PublicKey(pub [u8; 32]);

/// A private or preshared key. `Debug` and `Display` are redacted so it cannot leak into logs.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretKey(pub [u8; 32]);

/// Decodes a 32-byte base64 key, or says what is wrong with it.
pub fn decode_key(text: &str) -> Result<[u8; 32], String> {
    let bytes = STANDARD
        .decode(text.trim())
        .map_err(|_| "is not valid base64: expected a 44-character WireGuard key".to_string())?;
    <[u8; 32]>::try_from(bytes.as_slice()).map_err(|_| {
        format!(
            "decodes to {} bytes: expected a 32-byte WireGuard key",
            bytes.len()
        )
    })
}

impl PublicKey {
    pub fn to_base64(&self) -> String {
        STANDARD.encode(self.0)
    }
}

impl SecretKey {
    /// The public key that belongs to this private key.
    pub fn public_key(&self) -> PublicKey {
        let secret = x25519_dalek::StaticSecret::from(self.0);
        PublicKey(x25519_dalek::PublicKey::from(&secret).to_bytes())
    }

    /// A fresh random private key drawn from `rng`, clamped as `wg genkey` does. The caller
    /// brings the randomness (the shell passes `OsRng`): the core makes no system call.
    pub fn random(rng: &mut impl rand_core::CryptoRngCore) -> SecretKey {
        let secret = x25519_dalek::StaticSecret::random_from_rng(rng);
        SecretKey(secret.to_bytes())
    }

    /// A fresh random preshared key from `rng`: 32 random bytes, as `wg genpsk` prints.
    pub fn random_preshared(rng: &mut impl rand_core::CryptoRngCore) -> SecretKey {
        let mut bytes = [0u8; 32];
        rng.fill_bytes(&mut bytes);
        SecretKey(bytes)
    }

    /// The core's own tests: a fresh key from the operating system's generator.
    #[cfg(test)]
    pub(crate) fn generate() -> SecretKey {
        SecretKey::random(&mut rand_core::OsRng)
    }

    /// Only for writing the key where the user asked for it (genkey, UAPI private_key).
    pub fn expose_base64(&self) -> String {
        STANDARD.encode(self.0)
    }
}

impl fmt::Display for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_base64())
    }
}

impl fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PublicKey({})", self.to_base64())
    }
}

impl fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SecretKey(<redacted>)")
    }
}
