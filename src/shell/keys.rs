//! Fresh keys from the operating system's generator (`getrandom`): the randomness the pure
//! core takes from its caller (`SecretKey::random`), drawn here, in the shell.

use crate::config::SecretKey;

/// `SecretKey::generate()` and `SecretKey::generate_preshared()`, drawn from `OsRng`.
pub trait GenerateKey {
    /// A fresh private key, clamped as `wg genkey` does.
    fn generate() -> Self;
    /// A fresh preshared key, as `wg genpsk` prints.
    fn generate_preshared() -> Self;
}

impl GenerateKey for SecretKey {
    fn generate() -> SecretKey {
        SecretKey::random(&mut rand_core::OsRng)
    }

    fn generate_preshared() -> SecretKey {
        SecretKey::random_preshared(&mut rand_core::OsRng)
    }
}
