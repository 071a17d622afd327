//! Bounds-checked little-endian encoding of messages.
//!
//! Every RPC payload is built with [`WireWriter`] and parsed with
//! [`WireReader`]; a short or over-long payload is an error, never a panic.

use crate::error::{ServiceError, TransportError};
use thiserror::Error;

/// A payload that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("malformed payload: {0}")]
pub struct WireError(pub String);

impl From<WireError> for ServiceError {
    fn from(e: WireError) -> ServiceError {
        ServiceError::malformed(e.0)
    }
}

impl From<WireError> for TransportError {
    fn from(e: WireError) -> TransportError {
        TransportError::Malformed(e.0)
    }
}

/// Builds a payload.
#[derive(Debug, Default, Clone)]
pub struct WireWriter {
    buf: Vec<u8>,
}

impl WireWriter {
    #[inline]
    pub fn new() -> Self {
        WireWriter { buf: Vec::new() }
    }
    #[inline]
    pub fn with_capacity(n: usize) -> Self {
        WireWriter {
            buf: Vec::with_capacity(n),
        }
    }
    /// A writer that appends to `buf` (e.g. an endpoint's
    /// [`crate::Endpoint::request_buffer`]), reserving `n` more bytes.
    #[inline]
    pub fn append_to(mut buf: Vec<u8>, n: usize) -> Self {
        buf.reserve(n);
        WireWriter { buf }
    }
    #[inline]
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }
    #[inline]
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    #[inline]
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    #[inline]
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    #[inline]
    pub fn f64(&mut self, v: f64) -> &mut Self {
        self.u64(v.to_bits())
    }
    #[inline]
    pub fn bool(&mut self, v: bool) -> &mut Self {
        self.u8(v as u8)
    }
    /// A length-prefixed (u32) byte string.
    #[inline]
    pub fn bytes(&mut self, v: &[u8]) -> &mut Self {
        let len = u32::try_from(v.len()).expect("wire byte strings are below 4 GiB");
        self.u32(len);
        self.buf.extend_from_slice(v);
        self
    }
    /// A length-prefixed UTF-8 string.
    #[inline]
    pub fn str(&mut self, v: &str) -> &mut Self {
        self.bytes(v.as_bytes())
    }
    /// Bytes without a length prefix.
    #[inline]
    pub fn raw(&mut self, v: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(v);
        self
    }
    #[inline]
    pub fn len(&self) -> usize {
        self.buf.len()
    }
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
    #[inline]
    pub fn finish(self) -> Vec<u8> {
        self.buf
    }
}

/// Parses a payload.
#[derive(Debug, Clone)]
pub struct WireReader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> WireReader<'a> {
    #[inline]
    pub fn new(buf: &'a [u8]) -> Self {
        WireReader { buf, pos: 0 }
    }
    // Inlined, with the error's formatting out of line: the workspace
    // builds without LTO, and every engine's request and reply decoding
    // called these small readers across crates (~10 calls per RPC, each a
    // call and a `Result` through memory).
    #[inline]
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], WireError> {
        if self.buf.len() - self.pos < n {
            return Err(self.short(n, what));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    #[cold]
    #[inline(never)]
    fn short(&self, n: usize, what: &str) -> WireError {
        WireError(format!(
            "{what}: need {n} bytes at offset {}, payload has {}",
            self.pos,
            self.buf.len()
        ))
    }
    #[inline]
    pub fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1, "u8")?[0])
    }
    #[inline]
    pub fn u16(&mut self) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(
            self.take(2, "u16")?.try_into().expect("2 bytes"),
        ))
    }
    #[inline]
    pub fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(
            self.take(4, "u32")?.try_into().expect("4 bytes"),
        ))
    }
    #[inline]
    pub fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(
            self.take(8, "u64")?.try_into().expect("8 bytes"),
        ))
    }
    #[inline]
    pub fn f64(&mut self) -> Result<f64, WireError> {
        Ok(f64::from_bits(self.u64()?))
    }
    #[inline]
    pub fn bool(&mut self) -> Result<bool, WireError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(not_a_bool(v)),
        }
    }
    #[inline]
    pub fn bytes(&mut self) -> Result<&'a [u8], WireError> {
        let n = self.u32()? as usize;
        self.take(n, "byte string")
    }
    #[inline]
    pub fn str(&mut self) -> Result<&'a str, WireError> {
        std::str::from_utf8(self.bytes()?).map_err(|e| WireError(format!("string: {e}")))
    }
    #[inline]
    pub fn raw(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        self.take(n, "raw bytes")
    }
    /// A u32 element count, refused if even one-byte elements could not fit
    /// in what is left (so a hostile count cannot cause a huge allocation).
    #[inline]
    pub fn count(&mut self, min_elem_bytes: usize) -> Result<usize, WireError> {
        let n = self.u32()? as usize;
        if n.saturating_mul(min_elem_bytes.max(1)) > self.remaining() {
            return Err(WireError(format!("count {n} exceeds the payload")));
        }
        Ok(n)
    }
    #[inline]
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    /// Fails if bytes are left over.
    #[inline]
    pub fn end(&self) -> Result<(), WireError> {
        if self.remaining() != 0 {
            return Err(trailing(self.remaining()));
        }
        Ok(())
    }
}

// The readers' errors, formatted out of line so that `bool` and `end`
// inline into every reply's decoding (with the `format!` inside, `bool`
// was not inlined: a call per decoded flag, xstore's write replies two).
#[cold]
#[inline(never)]
fn not_a_bool(v: u8) -> WireError {
    WireError(format!("bool: byte {v} is neither 0 nor 1"))
}

#[cold]
#[inline(never)]
fn trailing(n: usize) -> WireError {
    WireError(format!("{n} trailing bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_short_input() {
        let mut w = WireWriter::new();
        w.u8(1)
            .u16(2)
            .u32(3)
            .u64(4)
            .bytes(b"abc")
            .str("hé")
            .bool(true)
            .f64(1.5);
        let buf = w.finish();
        let mut r = WireReader::new(&buf);
        assert_eq!(r.u8().unwrap(), 1);
        assert_eq!(r.u16().unwrap(), 2);
        assert_eq!(r.u32().unwrap(), 3);
        assert_eq!(r.u64().unwrap(), 4);
        assert_eq!(r.bytes().unwrap(), b"abc");
        assert_eq!(r.str().unwrap(), "hé");
        assert!(r.bool().unwrap());
        assert_eq!(r.f64().unwrap(), 1.5);
        r.end().unwrap();
        for cut in 0..buf.len() {
            let mut r = WireReader::new(&buf[..cut]);
            let all = (|| -> Result<(), WireError> {
                r.u8()?;
                r.u16()?;
                r.u32()?;
                r.u64()?;
                r.bytes()?;
                r.str()?;
                r.bool()?;
                r.f64()?;
                Ok(())
            })();
            assert!(all.is_err(), "a payload cut at {cut} must not parse");
        }
    }

    #[test]
    fn hostile_counts_are_refused() {
        let mut w = WireWriter::new();
        w.u32(u32::MAX);
        let buf = w.finish();
        assert!(WireReader::new(&buf).count(8).is_err());
        assert!(WireReader::new(&buf).bytes().is_err());
    }
}
