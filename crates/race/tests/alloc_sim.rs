//! The memory node's allocation RPC declares its work to the simulated
//! cluster's instruction term (docs/simulation.md, "Declared work, the
//! rest (branch i60)"): inserts that take new chunks from the memory node
//! make the report's `memnode declared instructions` a positive multiple
//! of `serve_alloc`'s constant (nothing else of this engine runs on the memory
//! node's CPU). Without the declaration (main before i60) nothing is
//! declared and the test fails.

#[test]
fn inserts_that_take_chunks_declare_the_allocation_rpcs() {
    // The smallest chunk: a few hundred inserts need several.
    dmkv_testkit::declared::inserts_declare_allocation_rpcs(
        &dmkv_race::SPEC,
        "8",
        dmkv_race::alloc::SERVE_ALLOC_WORK,
    );
}
