//! Misuse that must not compile (rule 3).
#![cfg(not(loom))]

#[test]
fn misuse_does_not_compile() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
