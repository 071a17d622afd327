//! `dmkv`: the benchmark harness (`dmkv bench`), a memory node for
//! multi-process runs (`dmkv memnode`, with the `ucx` feature) and an
//! interactive shell on an in-process engine (`dmkv shell`), deterministic
//! simulation testing (`dmkv dst`) and the papers' figures (`dmkv repro`).

#![forbid(unsafe_code)]

mod cli;
mod dst;
mod engines;
mod node;
mod repro;
mod shell;
#[cfg(feature = "ucx")]
mod ucx;

use std::io::{IsTerminal, Write};

/// mimalloc instead of glibc's malloc: every engine's data path allocates
/// (values returned by `get`, read buffers, engine futures), and glibc spends
/// ~150-400 instructions per malloc/free pair there, more for buffers above
/// its thread cache's 1 KiB (leaves, buckets); mimalloc's thread-local free
/// lists cost a few dozen. `dmkv_alloc` enters it through `mi_malloc` where
/// the layout allows, whose fast path reuses a block freed on the last op
/// (the `mimalloc` crate's `mi_malloc_aligned` does not); docs/performance.md
/// has the counts.
#[global_allocator]
static GLOBAL: dmkv_alloc::MiMalloc = dmkv_alloc::MiMalloc;

fn main() {
    let stdin = std::io::stdin();
    let stdin_is_terminal = stdin.is_terminal();
    let mut stdin = stdin.lock();
    let mut out = std::io::stdout().lock();
    let mut err = std::io::stderr();
    let progress = err.is_terminal();
    let code = cli::run(
        &engines::REGISTRY,
        std::env::args_os().collect(),
        &mut cli::Io {
            stdin: &mut stdin,
            stdin_is_terminal,
            out: &mut out,
            err: &mut err,
            progress,
        },
    );
    let _ = out.flush();
    std::process::exit(code);
}

#[cfg(test)]
mod tests;
