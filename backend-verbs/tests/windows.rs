//! Memory windows through the [`Engine`] interface, on the software NIC and
//! (feature `verbs`, in `scripts/rdma-lab`'s guest) on the device:
//!
//! - a type-2 window grants through the queue pair it was bound on only:
//!   a WRITE under its key on another queue pair is refused, memory unchanged
//!   (the positive control of the next case: why a peer that stripes its
//!   slices needs type 1);
//! - a type-1 window ([`Engine::alloc_pd_window`]) grants through every
//!   queue pair of the engine; freed, its key is refused and memory is
//!   unchanged.
//!
//! On a host without a device the device cases are listed as ignored, with
//! what they need; in the guest (`KVT_RDMA_LAB=1`) a missing device fails.

use std::sync::Arc;
use std::time::{Duration, Instant};

use backend_verbs::{Engine, FakeFabric, MrAccess, QpId, WcStatus, WorkRequest};
use kv_transfer_core::{HostRegion, Region};
use libtest_mimic::{Arguments, Failed, Trial};

const LEN: usize = 8192;

/// Two engines: `target` holds the memory, `init` writes into it through
/// two connected queue pairs.
struct Nics {
    target: Arc<dyn Engine>,
    init: Arc<dyn Engine>,
}

fn wait(e: &dyn Engine, wr_id: u64) -> Result<WcStatus, String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(c) = e.poll(16).map_err(|e| e.to_string())?.into_iter().find(|c| c.wr_id == wr_id) {
            return Ok(c.status);
        }
        if Instant::now() >= deadline {
            return Err(format!("no completion of {wr_id} in 10 s"));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A connected pair: (initiator's QP, target's QP).
fn pair(n: &Nics) -> Result<(QpId, QpId), String> {
    let a = n.init.create_qp(1024).map_err(|e| e.to_string())?;
    let b = n.target.create_qp(1024).map_err(|e| e.to_string())?;
    n.init.connect(QpId(a.qpn), &b).map_err(|e| e.to_string())?;
    n.target.connect(QpId(b.qpn), &a).map_err(|e| e.to_string())?;
    Ok((QpId(a.qpn), QpId(b.qpn)))
}

struct Setup {
    mem: Arc<HostRegion>,
    mr: backend_verbs::MrInfo,
    src: backend_verbs::MrInfo,
}

fn setup(n: &Nics) -> Result<Setup, String> {
    let mem = Arc::new(HostRegion::new(LEN).map_err(|e| e.to_string())?);
    mem.write(0, &[0x11; LEN]).map_err(|e| e.to_string())?;
    let mr = n.target.register(mem.clone(), MrAccess::WindowsOnly).map_err(|e| e.to_string())?;
    let source = Arc::new(HostRegion::new(LEN).map_err(|e| e.to_string())?);
    source.write(0, &[0xee; LEN]).map_err(|e| e.to_string())?;
    let src = n.init.register(source, MrAccess::Local).map_err(|e| e.to_string())?;
    Ok(Setup { mem, mr, src })
}

fn bind(n: &Nics, qp: QpId, mw: backend_verbs::MwId, s: &Setup, wr_id: u64) -> Result<u32, String> {
    let wr = WorkRequest::Bind { window: mw, mr: s.mr.id, offset: 0, len: LEN as u32 };
    let key = n.target.post(qp, wr_id, wr).map_err(|e| e.to_string())?.ok_or("a bind without a key")?;
    match wait(n.target.as_ref(), wr_id)? {
        WcStatus::Success => Ok(key),
        other => Err(format!("bind: {other:?}")),
    }
}

fn write(n: &Nics, qp: QpId, s: &Setup, key: u32, wr_id: u64) -> Result<WcStatus, String> {
    let wr = WorkRequest::Write { local: s.src.id, offset: 0, len: 64, remote_addr: s.mr.addr, rkey: key };
    n.init.post(qp, wr_id, wr).map_err(|e| e.to_string())?;
    wait(n.init.as_ref(), wr_id)
}

fn untouched(s: &Setup) -> Result<bool, String> {
    let mut b = vec![0u8; LEN];
    s.mem.read(0, &mut b).map_err(|e| e.to_string())?;
    Ok(b.iter().all(|x| *x == 0x11))
}

fn type2_grants_through_its_own_queue_pair_only(n: &Nics) -> Result<(), String> {
    let s = setup(n)?;
    let (i0, t0) = pair(n)?;
    let (i1, _t1) = pair(n)?;
    let mw = n.target.alloc_window().map_err(|e| e.to_string())?;
    let key = bind(n, t0, mw, &s, 1)?;
    match write(n, i1, &s, key, 2)? {
        WcStatus::RemoteAccess => {}
        other => return Err(format!("a type-2 window's key on another queue pair: {other:?}, not refused")),
    }
    if !untouched(&s)? {
        return Err("the refused WRITE changed memory".into());
    }
    match write(n, i0, &s, key, 3)? {
        WcStatus::Success => Ok(()),
        other => Err(format!("its own queue pair: {other:?}")),
    }
}

fn type1_grants_through_every_queue_pair_and_ends_when_freed(n: &Nics) -> Result<(), String> {
    let s = setup(n)?;
    // Bound on a queue pair of its own, as `RdmaTarget` does.
    let (_bi, bt) = pair(n)?;
    let (i0, _t0) = pair(n)?;
    let (i1, _t1) = pair(n)?;
    let mw = n.target.alloc_pd_window().map_err(|e| e.to_string())?;
    let key = bind(n, bt, mw, &s, 10)?;
    for (qp, wr) in [(i0, 11), (i1, 12)] {
        match write(n, qp, &s, key, wr)? {
            WcStatus::Success => {}
            other => return Err(format!("a type-1 window's key on queue pair {}: {other:?}", qp.0)),
        }
    }
    n.target.free_window(mw);
    s.mem.write(0, &[0x11; LEN]).map_err(|e| e.to_string())?;
    match write(n, i0, &s, key, 13)? {
        WcStatus::RemoteAccess => {}
        other => return Err(format!("the freed window's key: {other:?}, not refused")),
    }
    if !untouched(&s)? {
        return Err("a WRITE under a freed window's key changed memory".into());
    }
    Ok(())
}

type Check = fn(&Nics) -> Result<(), String>;
const CHECKS: &[(&str, Check)] = &[
    ("type2_window_grants_through_its_own_queue_pair_only", type2_grants_through_its_own_queue_pair_only),
    (
        "type1_window_grants_through_every_queue_pair_and_ends_when_freed",
        type1_grants_through_every_queue_pair_and_ends_when_freed,
    ),
];

fn main() {
    let args = Arguments::from_args();
    let env = backend_verbs::LabEnv::from_env();
    let mut trials = Vec::new();
    for &(name, check) in CHECKS {
        trials.push(Trial::test(format!("{name}::fake"), move || {
            let f = FakeFabric::new(0x77);
            check(&Nics { target: Arc::new(f.fake_nic()), init: Arc::new(f.fake_nic()) }).map_err(Failed::from)
        }));
        #[cfg(feature = "verbs")]
        {
            let env = env.clone();
            let missing = backend_verbs::Context::open(&env.device).err().map(|e| e.to_string());
            let ignored = missing.is_some() && !env.in_lab;
            if let (Some(why), false) = (&missing, args.list) {
                if !env.in_lab {
                    eprintln!("ignored: {name}::device: needs a verbs device ({why}): scripts/rdma-lab test");
                }
            }
            trials.push(
                Trial::test(format!("{name}::device"), move || {
                    let open = || {
                        backend_verbs::DeviceEngine::open(&env.device, 1, env.gid_index)
                            .map(|e| e as Arc<dyn Engine>)
                            .map_err(|e| Failed::from(e.to_string()))
                    };
                    check(&Nics { target: open()?, init: open()? }).map_err(Failed::from)
                })
                .with_ignored_flag(ignored),
            );
        }
    }
    #[cfg(not(feature = "verbs"))]
    {
        let _ = &env;
        trials.push(Trial::test("device_cases_need_the_feature_verbs", || Ok(())).with_ignored_flag(true));
    }
    libtest_mimic::run(&args, trials).exit();
}
