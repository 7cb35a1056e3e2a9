//! Helpers of the hostile-peer tests: two adapters on loopback, a raw
//! client of Mooncake's public wire formats, connections from another
//! loopback address, and memory figures.
#![allow(dead_code, unused_imports)]

pub use netns_lab::{connect_from, proc_status};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use backend_mooncake::proto::{HandshakeFrame, HandshakeType, RequestHeader, StatusWord, TcpOpcode, MAX_HANDSHAKE_LEN};
use backend_mooncake::{AdapterConfig, EngineConfig, MooncakeEngine, MooncakeTransfer};
use kv_transfer_core::{EscalationLadder, HostRegion, PoolConfig, SlotPool};

/// An adapter over its own engine, with one pool.
pub struct Side {
    pub a: MooncakeTransfer,
    pub engine: Arc<MooncakeEngine>,
    pub pool: SlotPool,
    pub region: Arc<HostRegion>,
}

pub fn side_with(ecfg: EngineConfig, acfg: AdapterConfig, slots: usize, slot: usize) -> Side {
    let engine = Arc::new(MooncakeEngine::new(ecfg).unwrap());
    let a = MooncakeTransfer::new(engine.clone(), acfg).unwrap();
    let region = Arc::new(HostRegion::new(slots * slot).unwrap());
    let pool = a.register_pool(region.clone(), PoolConfig::new(slot).with_ladder(EscalationLadder::default())).unwrap();
    Side { a, engine, pool, region }
}

pub fn side(slots: usize, slot: usize) -> Side {
    side_with(EngineConfig::default(), AdapterConfig::default(), slots, slot)
}

pub use kv_transfer_testkit::wait::wait_for as wait_until;

pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed).wrapping_add((i >> 9) as u8)).collect()
}

/// The attacker's address.
pub const ATTACKER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);

/// One request on Mooncake's TCP data port, v2 framing, as anyone can
/// send it: `Ok(bytes)` read back (READ) or `Ok(empty)` (WRITE applied),
/// `Err` when the target rejected it.
pub fn raw_request(s: &mut TcpStream, op: TcpOpcode, addr: u64, data: &[u8], size: u64) -> Result<Vec<u8>, String> {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let hdr = RequestHeader { size, addr, opcode: op, v2: true }.encode();
    s.write_all(&hdr).map_err(|e| e.to_string())?;
    if op == TcpOpcode::Write {
        s.write_all(data).map_err(|e| e.to_string())?;
    }
    let mut w = [0u8; 8];
    s.read_exact(&mut w).map_err(|e| e.to_string())?;
    match StatusWord::decode(&w).map_err(|e| e.to_string())? {
        StatusWord::AddrRejected => Err("AddrRejected".into()),
        StatusWord::Ok if op == TcpOpcode::Read => {
            let mut out = vec![0u8; size as usize];
            s.read_exact(&mut out).map_err(|e| e.to_string())?;
            Ok(out)
        }
        StatusWord::Ok => Ok(Vec::new()),
    }
}

/// One handshake exchange from `src` (the public framing).
pub fn raw_handshake(src: Ipv4Addr, dst: SocketAddr, kind: HandshakeType, json: &[u8]) -> Result<Vec<u8>, String> {
    let mut s = connect_from(src, dst).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    HandshakeFrame::new(kind, json.to_vec()).write_to(&mut s).map_err(|e| e.to_string())?;
    let f = HandshakeFrame::read_from(&mut s, MAX_HANDSHAKE_LEN).map_err(|e| e.to_string())?;
    Ok(f.json)
}

/// A notification from `src` declaring `name`; the receiver's reply text.
pub fn raw_notify(src: Ipv4Addr, dst: SocketAddr, name: &str, msg: &str) -> Result<String, String> {
    let body = serde_json::json!({ "name": name, "notify_msg": msg }).to_string();
    let reply = raw_handshake(src, dst, HandshakeType::Notify, body.as_bytes())?;
    let v: serde_json::Value = serde_json::from_slice(&reply).map_err(|e| e.to_string())?;
    Ok(v.get("notify_msg").and_then(|m| m.as_str()).unwrap_or_default().to_string())
}

/// Resets the peak RSS (VmHWM) to the current RSS (Linux `clear_refs` 5).
pub fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// Memory and threads now.
#[derive(Debug, Clone, Copy)]
pub struct Mem {
    pub rss_kib: u64,
    pub hwm_kib: u64,
    pub threads: u64,
}

pub fn mem() -> Mem {
    Mem { rss_kib: proc_status("VmRSS:"), hwm_kib: proc_status("VmHWM:"), threads: proc_status("Threads:") }
}
