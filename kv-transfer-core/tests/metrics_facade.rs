//! With the `metrics` feature, pool events reach the `metrics` facade.
#![cfg(all(feature = "metrics", not(loom)))]

use kv_transfer_core::*;
use metrics::{Counter, CounterFn, Gauge, GaugeFn, Histogram, HistogramFn, Key, KeyName, Metadata, SharedString, Unit};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

#[derive(Default)]
struct Cell(Mutex<f64>);
impl CounterFn for Cell {
    fn increment(&self, v: u64) {
        *self.0.lock().unwrap() += v as f64;
    }
    fn absolute(&self, v: u64) {
        *self.0.lock().unwrap() = v as f64;
    }
}
impl GaugeFn for Cell {
    fn increment(&self, v: f64) {
        *self.0.lock().unwrap() += v;
    }
    fn decrement(&self, v: f64) {
        *self.0.lock().unwrap() -= v;
    }
    fn set(&self, v: f64) {
        *self.0.lock().unwrap() = v;
    }
}
impl HistogramFn for Cell {
    fn record(&self, _v: f64) {
        *self.0.lock().unwrap() += 1.0;
    }
}

#[derive(Default)]
struct Recorder(Mutex<HashMap<String, Arc<Cell>>>);
impl Recorder {
    fn cell(&self, key: &Key) -> Arc<Cell> {
        self.0.lock().unwrap().entry(key.name().to_string()).or_default().clone()
    }
    fn get(&self, name: &str) -> f64 {
        self.0.lock().unwrap().get(name).map(|c| *c.0.lock().unwrap()).unwrap_or(-1.0)
    }
}
impl metrics::Recorder for Recorder {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(self.cell(key))
    }
    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::from_arc(self.cell(key))
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::from_arc(self.cell(key))
    }
}

#[test]
fn lifecycle_events_reach_the_facade() {
    let rec = Recorder::default();
    metrics::with_local_recorder(&rec, || {
        let (pool, authority) = SlotPool::new(Arc::new(HostRegion::new(4 * 64).unwrap()), PoolConfig::new(64)).unwrap();
        let _ = pool.reserve(5);
        let (exposed, remote) = authority.expose(pool.reserve(2).unwrap(), PeerId(1), 1, "t", Default::default());
        exposed.abort();
        assert_eq!(rec.get("kvt_quarantined_slots"), 2.0);
        authority.deliver(authority.completed(&remote.tenancies()));
        authority.deliver(authority.completed(&remote.tenancies()));
    });
    assert_eq!(rec.get("kvt_admission_rejected_total"), 1.0);
    assert_eq!(rec.get("kvt_leases_total"), 1.0);
    assert_eq!(rec.get("kvt_exposures_total"), 1.0);
    assert_eq!(rec.get("kvt_quarantined_slots_total"), 2.0);
    assert_eq!(rec.get("kvt_settled_completed_total"), 2.0);
    assert_eq!(rec.get("kvt_stale_rejected_total"), 2.0);
    assert_eq!(rec.get("kvt_quarantined_slots"), 0.0);
    assert_eq!(rec.get("kvt_abort_to_reclaim_seconds"), 1.0);
}
