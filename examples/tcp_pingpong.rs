//! What loopback TCP itself costs per request/reply, as a floor for RPCs over
//! `--transport ucx` with `UCX_TLS=tcp` (docs/performance.md, issue 13
//! item 5): a plain socket ping-pong with RPC-sized messages and nothing
//! else (no framing library, no executor, no UCX).
//!
//! ```text
//! cargo run --release --example tcp_pingpong -- [round_trips] [in_flight] [request_bytes] [reply_bytes]
//! ```
//!
//! The server is a thread of this process serving one connection; the client
//! keeps `in_flight` requests outstanding on it (1: latency; 8: what a
//! compute thread with 8 tasks keeps in flight). Defaults: 100,000 round
//! trips, 8 in flight, 9-byte requests and 13-byte replies (an rpc-hash GET
//! with 8-byte values). Prints round trips per second, the mean time per
//! round trip, and the thread CPU time per round trip of server and client.

use dmkv_transport::thread_cpu_ns;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

fn arg(n: usize, default: usize) -> usize {
    std::env::args()
        .nth(n)
        .map(|s| s.parse().expect("a number"))
        .unwrap_or(default)
}

fn main() -> std::io::Result<()> {
    let round_trips = arg(1, 100_000);
    let in_flight = arg(2, 8).clamp(1, round_trips.max(1));
    let (req_len, reply_len) = (arg(3, 9), arg(4, 13));
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let server = std::thread::spawn(move || -> std::io::Result<u64> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let cpu0 = thread_cpu_ns();
        let mut req = vec![0u8; req_len];
        let reply = vec![1u8; reply_len];
        for _ in 0..round_trips {
            s.read_exact(&mut req)?;
            s.write_all(&reply)?;
        }
        Ok(thread_cpu_ns() - cpu0)
    });
    let mut c = TcpStream::connect(addr)?;
    c.set_nodelay(true)?;
    let req = vec![2u8; req_len];
    let mut reply = vec![0u8; reply_len];
    let (t0, cpu0) = (Instant::now(), thread_cpu_ns());
    let mut sent = 0;
    for _ in 0..in_flight {
        c.write_all(&req)?;
        sent += 1;
    }
    for _ in 0..round_trips {
        c.read_exact(&mut reply)?;
        assert!(reply.iter().all(|&b| b == 1), "a reply as sent");
        if sent < round_trips {
            c.write_all(&req)?;
            sent += 1;
        }
    }
    let (wall, client_cpu) = (t0.elapsed(), thread_cpu_ns() - cpu0);
    let server_cpu = server.join().expect("the server thread")?;
    let n = round_trips as f64;
    println!(
        "tcp ping-pong over loopback: {round_trips} round trips, {in_flight} in flight, \
         {req_len} B requests, {reply_len} B replies"
    );
    println!(
        "  {:.0} round trips/s, {:.2} us per round trip (wall / round trips)",
        n / wall.as_secs_f64(),
        wall.as_secs_f64() * 1e6 / n
    );
    println!(
        "  thread CPU per round trip: server {:.2} us, client {:.2} us",
        server_cpu as f64 / n / 1e3,
        client_cpu as f64 / n / 1e3
    );
    Ok(())
}
