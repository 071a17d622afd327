//! Embeds the git commit the binary is built from (`DMKV_GIT_COMMIT`), so
//! that `dmkv bench --json` and `dmkv repro` record it. Without git, or
//! outside a repository, it is "unknown" and the build goes on.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!s.is_empty()).then_some(s)
}

fn main() {
    let commit = git(&["rev-parse", "HEAD"]).unwrap_or_else(|| "unknown".into());
    // "-dirty" when tracked files differed from the commit at build time.
    let dirty = commit != "unknown"
        && Command::new("git")
            .args(["diff", "--quiet", "HEAD", "--"])
            .status()
            .is_ok_and(|s| s.code() == Some(1));
    let suffix = if dirty { "-dirty" } else { "" };
    println!("cargo:rustc-env=DMKV_GIT_COMMIT={commit}{suffix}");
    // Rebuild the stamp when HEAD moves or the index changes.
    if let Some(dir) = git(&["rev-parse", "--git-dir"]) {
        println!("cargo:rerun-if-changed={dir}/HEAD");
        println!("cargo:rerun-if-changed={dir}/index");
        if let Some(r) = git(&["symbolic-ref", "-q", "HEAD"]) {
            let common = git(&["rev-parse", "--git-common-dir"]).unwrap_or(dir);
            println!("cargo:rerun-if-changed={common}/{r}");
        }
    }
    println!("cargo:rerun-if-changed=build.rs");
}
