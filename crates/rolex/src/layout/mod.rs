//! Remote byte layouts, parsed through bounds-checked views. Everything is
//! little-endian 8-byte words; see docs/rolex.md for the pictures.

pub mod entry;
pub mod leaf;
pub mod meta;
pub mod record;
pub mod value;
