//! The control channel: one TCP connection from each client process to each
//! serving node, outside UCX.
//!
//! It carries what must be authenticated or must not depend on UCX's own
//! connection state:
//!
//! 1. **Handshake** (mutual, the secret never crosses the wire): the client
//!    sends `HELLO(magic, client nonce, client node id)`; the server answers
//!    `CHALLENGE(server nonce, HMAC(secret, "server" | nonces | id))`; the
//!    client checks it and sends `PROOF(HMAC(secret, "client" | nonces | id))`;
//!    the server checks that and answers `WELCOME(node id)` or
//!    `REFUSED(reason)` and closes. A peer without the secret never learns
//!    a worker address of the node and gets no session.
//! 2. **Sessions**: a client thread's UCX worker is registered with
//!    `OPEN_SESSION(worker address, host id)`; the node connects back to it
//!    from every worker it serves with (verbs replies, RPC replies) and
//!    returns `SESSION(session id, random token, handler worker addresses,
//!    host id, progress worker address)`: every RPC carries the token, and
//!    goes to one of the handler threads' workers, which serve RPCs inline;
//!    verbs messages go to the progress worker. Equal host ids make both
//!    sides' UCX endpoints shared-memory ones (`crate::shm`), and then the
//!    workers named are ones the node made for this client process alone
//!    (`crate::server`, invariant 4).
//! 3. **Remote keys**: `FETCH_RKEY(region, access key)` returns the region's
//!    base address, length and packed rkey, or a refusal. A wrong access key
//!    is refused here, before any byte moves.
//! 4. **Invalidation**: `INVALIDATE(seq, region)` tells a client process that
//!    a region was withdrawn; it acknowledges with `ACK(seq)` once no new
//!    access can use the old rkey.
//! 5. **Liveness**: the connection lives as long as the client process's
//!    view of the node; its end (EOF, reset) means the peer is gone.
//!
//! Frames are `len u32 | kind u8 | body`, little-endian, at most
//! [`MAX_FRAME`] bytes.

use dmkv_transport::{WireReader, WireWriter};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// Largest control frame accepted (worker addresses and packed rkeys are a
/// few hundred bytes to a few KiB).
pub const MAX_FRAME: usize = 1 << 20;
/// How long either side waits for the other during the handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

const MAGIC: &[u8] = b"dmkv-ucx/1";

pub const HELLO: u8 = 1;
pub const CHALLENGE: u8 = 2;
pub const PROOF: u8 = 3;
pub const WELCOME: u8 = 4;
pub const REFUSED: u8 = 5;
pub const OPEN_SESSION: u8 = 10;
pub const SESSION: u8 = 11;
pub const CLOSE_SESSION: u8 = 12;
pub const FETCH_RKEY: u8 = 13;
pub const RKEY: u8 = 14;
pub const DENIED: u8 = 15;
pub const INVALIDATE: u8 = 16;
pub const ACK: u8 = 17;

/// Refusal codes in `DENIED`.
pub const DENIED_NO_REGION: u8 = 1;
pub const DENIED_WRONG_KEY: u8 = 2;
pub const DENIED_OTHER: u8 = 3;

/// Writes one frame.
pub fn write_frame(mut s: &TcpStream, kind: u8, body: &[u8]) -> io::Result<()> {
    let len = u32::try_from(body.len() + 1)
        .ok()
        .filter(|&l| l as usize <= MAX_FRAME)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "control frame too large"))?;
    let mut buf = Vec::with_capacity(5 + body.len());
    buf.extend_from_slice(&len.to_le_bytes());
    buf.push(kind);
    buf.extend_from_slice(body);
    s.write_all(&buf)
}

/// Reads one frame: `(kind, body)`.
pub fn read_frame(mut s: &TcpStream) -> io::Result<(u8, Vec<u8>)> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len == 0 || len > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("control frame of {len} bytes"),
        ));
    }
    let mut buf = vec![0u8; len];
    s.read_exact(&mut buf)?;
    let kind = buf[0];
    buf.remove(0);
    Ok((kind, buf))
}

fn proof(secret: &[u8], role: &[u8], cn: &[u8], sn: &[u8], client: u16) -> [u8; 32] {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes keys of any length");
    mac.update(role);
    mac.update(cn);
    mac.update(sn);
    mac.update(&client.to_le_bytes());
    mac.finalize().into_bytes().into()
}

fn verify(secret: &[u8], role: &[u8], cn: &[u8], sn: &[u8], client: u16, got: &[u8]) -> bool {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes keys of any length");
    mac.update(role);
    mac.update(cn);
    mac.update(sn);
    mac.update(&client.to_le_bytes());
    // Constant-time comparison.
    mac.verify_slice(got).is_ok()
}

fn nonce() -> [u8; 32] {
    use rand::RngCore;
    let mut n = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut n);
    n
}

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// What a client learns from a successful handshake.
pub struct Welcome {
    pub node: u16,
}

/// Why a handshake failed.
#[derive(Debug)]
pub enum HandshakeError {
    Io(io::Error),
    /// The other side does not know the cluster secret (or refused us).
    Refused(String),
}

impl From<io::Error> for HandshakeError {
    fn from(e: io::Error) -> Self {
        HandshakeError::Io(e)
    }
}

impl From<dmkv_transport::WireError> for HandshakeError {
    fn from(e: dmkv_transport::WireError) -> Self {
        HandshakeError::Io(bad(e.0))
    }
}

/// The client's side of the handshake.
pub fn client_handshake(
    s: &TcpStream,
    secret: &[u8],
    client: u16,
) -> Result<Welcome, HandshakeError> {
    s.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    let cn = nonce();
    let mut w = WireWriter::new();
    w.bytes(MAGIC).raw(&cn).u16(client);
    write_frame(s, HELLO, &w.finish())?;
    let (kind, body) = read_frame(s)?;
    if kind == REFUSED {
        return Err(HandshakeError::Refused(
            String::from_utf8_lossy(&body).into_owned(),
        ));
    }
    if kind != CHALLENGE {
        return Err(bad(format!("expected a challenge, got frame kind {kind}")).into());
    }
    let mut r = WireReader::new(&body);
    let sn = r.raw(32)?.to_vec();
    let server_proof = r.raw(32)?;
    r.end()?;
    if !verify(secret, b"server", &cn, &sn, client, server_proof) {
        return Err(HandshakeError::Refused(
            "the node does not know the cluster secret".into(),
        ));
    }
    write_frame(s, PROOF, &proof(secret, b"client", &cn, &sn, client))?;
    let (kind, body) = read_frame(s)?;
    match kind {
        WELCOME => {
            let mut r = WireReader::new(&body);
            let node = r.u16()?;
            r.end()?;
            s.set_read_timeout(None)?;
            Ok(Welcome { node })
        }
        REFUSED => Err(HandshakeError::Refused(
            String::from_utf8_lossy(&body).into_owned(),
        )),
        k => Err(bad(format!("expected a welcome, got frame kind {k}")).into()),
    }
}

/// The server's side of the handshake; returns the client's node id. On a
/// wrong proof it sends `REFUSED` and fails.
pub fn server_handshake(s: &TcpStream, secret: &[u8], node: u16) -> Result<u16, HandshakeError> {
    s.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    let (kind, body) = read_frame(s)?;
    if kind != HELLO {
        return Err(bad(format!("expected hello, got frame kind {kind}")).into());
    }
    let mut r = WireReader::new(&body);
    if r.bytes()? != MAGIC {
        let _ = write_frame(s, REFUSED, b"unknown protocol");
        return Err(bad("unknown protocol").into());
    }
    let cn = r.raw(32)?.to_vec();
    let client = r.u16()?;
    r.end()?;
    let sn = nonce();
    let mut w = WireWriter::new();
    w.raw(&sn).raw(&proof(secret, b"server", &cn, &sn, client));
    write_frame(s, CHALLENGE, &w.finish())?;
    let (kind, body) = read_frame(s)?;
    if kind != PROOF || !verify(secret, b"client", &cn, &sn, client, &body) {
        let _ = write_frame(s, REFUSED, b"refused: wrong cluster secret");
        return Err(HandshakeError::Refused(
            "the peer does not know the cluster secret".into(),
        ));
    }
    let mut w = WireWriter::new();
    w.u16(node);
    write_frame(s, WELCOME, &w.finish())?;
    s.set_read_timeout(None)?;
    Ok(client)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        (c, s)
    }

    #[test]
    fn matching_secrets_shake_hands() {
        let (c, s) = pair();
        let server = std::thread::spawn(move || server_handshake(&s, b"k1", 3));
        let w = client_handshake(&c, b"k1", 9).unwrap();
        assert_eq!(w.node, 3);
        assert_eq!(server.join().unwrap().unwrap(), 9);
    }

    #[test]
    fn a_wrong_secret_is_refused_both_ways() {
        let (c, s) = pair();
        let server = std::thread::spawn(move || server_handshake(&s, b"right", 3));
        let e = client_handshake(&c, b"wrong", 9).err().unwrap();
        assert!(matches!(e, HandshakeError::Refused(_)), "{e:?}");
        // The client stopped at the server's proof; the server never sent
        // its worker address.
        drop(c);
        assert!(server.join().unwrap().is_err());
    }

    #[test]
    fn a_forged_client_proof_is_refused() {
        let (c, s) = pair();
        let server = std::thread::spawn(move || server_handshake(&s, b"right", 3));
        // Speak the protocol by hand with a made-up proof.
        let mut w = WireWriter::new();
        w.bytes(MAGIC).raw(&[7; 32]).u16(1);
        write_frame(&c, HELLO, &w.finish()).unwrap();
        let (k, _) = read_frame(&c).unwrap();
        assert_eq!(k, CHALLENGE);
        write_frame(&c, PROOF, &[0; 32]).unwrap();
        let (k, body) = read_frame(&c).unwrap();
        assert_eq!(k, REFUSED, "{}", String::from_utf8_lossy(&body));
        assert!(matches!(
            server.join().unwrap(),
            Err(HandshakeError::Refused(_))
        ));
    }

    #[test]
    fn oversized_frames_are_refused() {
        let (mut c, s) = pair();
        c.write_all(&u32::MAX.to_le_bytes()).unwrap();
        assert!(read_frame(&s).is_err());
    }
}
