//! Generates N random strings of LEN bytes as `--value-gen random-string`
//! does, for counting the instructions of one under callgrind
//! (`dmkv_bench::valuegen::string_instructions`):
//! `valgrind --tool=callgrind --toggle-collect='*random_strings*'
//! target/release/examples/value-gen-instructions N LEN`.

fn main() {
    let mut args = std::env::args().skip(1);
    let mut arg = |what: &str| -> usize {
        args.next()
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("usage: value-gen-instructions N LEN (missing {what})"))
    };
    let (n, len) = (arg("N"), arg("LEN"));
    let mut mt = dmkv_bench::mt64::Mt64::new(1);
    println!(
        "{}",
        dmkv_bench::valuegen::random_strings(&mut mt, n, len.max(1))
    );
}
