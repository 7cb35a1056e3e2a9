//! The "what each backend can prove" table (docs/THREAT-MODEL.md) says what each backend
//! declares (`CAPABILITIES`), and nothing else: the ladder is built from the
//! declarations, so a table that drifted from them would mislead operators.

use kv_transfer_core::drain::Capabilities;

/// Each backend compiled in, with what it declares.
fn declared() -> Vec<(&'static str, Capabilities)> {
    #[allow(unused_mut)]
    let mut v = vec![("tcp-sim", backend_tcp_sim::CAPABILITIES)];
    #[cfg(feature = "mori")]
    v.push(("mori", backend_mori::sim::CAPABILITIES));
    #[cfg(feature = "mori")]
    v.push(("mori-verbs", backend_mori::verbs::capabilities(backend_mori::verbs::Access::WindowPerTenancy)));
    #[cfg(feature = "nixl")]
    v.push(("nixl", backend_nixl::adapter::CAPABILITIES));
    #[cfg(feature = "mooncake")]
    v.push(("mooncake", backend_mooncake::adapter::CAPABILITIES));
    #[cfg(feature = "mooncake")]
    v.push(("mooncake-rdma", backend_mooncake::adapter::CAPABILITIES_WITH_KEYS));
    #[cfg(feature = "verbs")]
    v.push(("verbs", backend_verbs::adapter::CAPABILITIES));
    v
}

/// The table's rows: backend name → (drain, revoke, fence), read from the
/// "yes"/"no" each cell starts with.
fn table() -> Vec<(String, [bool; 3])> {
    let readme = include_str!("../../docs/THREAT-MODEL.md");
    let start = readme.find("| backend | drain + ack | revoke | fence |").expect("the capabilities table");
    readme[start..]
        .lines()
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let yes = |c: &str| match c.split([':', ' ']).next() {
                Some("yes") => true,
                Some("no") => false,
                _ => panic!("a capability cell must start with yes or no: {c:?}"),
            };
            (cells[1].to_string(), [yes(cells[2]), yes(cells[3]), yes(cells[4])])
        })
        .collect()
}

#[test]
fn capabilities_table_in_the_threat_model_matches_what_each_backend_declares() {
    let rows = table();
    assert_eq!(rows.len(), 7, "one row per backend: {rows:?}");
    for (name, caps) in declared() {
        let Some((_, row)) = rows.iter().find(|(n, _)| n == name) else { panic!("no THREAT-MODEL.md row for {name}") };
        assert_eq!(
            *row,
            [caps.drain, caps.revoke, caps.fence],
            "THREAT-MODEL.md row for {name} disagrees with its CAPABILITIES"
        );
    }
}
