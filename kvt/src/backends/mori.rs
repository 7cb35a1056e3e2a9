//! The mori backend's loopback rig (being wired; see `super::Rig`).

use super::Rig;

pub fn rig(_slots: usize, _block: usize) -> anyhow::Result<Rig> {
    anyhow::bail!("kvt bench --backend mori: the adapter is compiled in but its loopback rig is not wired yet")
}
