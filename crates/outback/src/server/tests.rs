#![allow(clippy::disallowed_methods)] // tests use real threads and clocks
//! The rebuild protocol step by step, on one memory node driven with raw
//! requests: writes that arrive while a table is being rebuilt are
//! buffered (inserts, deletes) or served (updates), and applied afterwards;
//! requests naming the old epoch are told STALE.

use super::{NodeServer, serve_node};
use crate::hash::{candidates, slot};
use crate::proto::{DataReq, ReplyHead, Status, Target, op};
use crate::server::table::state;
use dmkv_api::{Knobs, ServeArgs};
use dmkv_memnode::NodeRuntime;
use dmkv_transport::local::{LocalCluster, LocalConfig};
use dmkv_transport::{WireReader, WireWriter};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

fn node() -> (LocalCluster, Arc<NodeRuntime>, Arc<NodeServer>) {
    let c = LocalCluster::new(LocalConfig::default());
    let rt = NodeRuntime::new(c.add_node(1));
    let mut knobs = Knobs::new();
    knobs.set("initial_buckets", "4");
    // More than four keys split on a resize (fewer grow the table alone).
    knobs.set("table_keys", "4");
    knobs.set("countdown_timeout_ms", "10");
    knobs.set("heap_mb", "4");
    let args = ServeArgs {
        instance: "t/outback".into(),
        knobs,
        node_index: 0,
        nodes: vec![rt.id().0],
        expected_keys: 100,
        value_size: 8,
        cache_mb: 0,
        data_dir: None,
    };
    let s = serve_node(&rt, &args).unwrap();
    (c, rt, s)
}

fn head(reply: &[u8]) -> (ReplyHead, WireReader<'_>) {
    let mut r = WireReader::new(reply);
    (ReplyHead::read(&mut r).unwrap(), r)
}

/// The request target and slot a compute node would compute for `key` in
/// table `id` with the latest seed.
fn target(s: &NodeServer, id: u32, key: u64) -> (Target, u8) {
    let shard = s.shard(0).unwrap().unwrap();
    let t = shard.table(id).unwrap();
    let b = candidates(key, t.bucket_seed, t.buckets)[t.othello.lookup(key) as usize];
    let tgt = Target {
        shard: 0,
        table: id,
        epoch: t.epoch.load(Ordering::Acquire),
        bucket: b,
        compute: 1,
    };
    (tgt, slot(key, t.seed(b)) as u8)
}

fn insert(s: &Arc<NodeServer>, key: u64, v: &[u8]) -> Vec<u8> {
    let (t, _) = target(s, 0, key);
    s.handle(
        &DataReq::Insert {
            t,
            key,
            value: v,
            upsert: false,
        }
        .encode(),
    )
    .unwrap()
}

fn get(s: &Arc<NodeServer>, key: u64) -> Option<Vec<u8>> {
    let shard = s.shard(0).unwrap().unwrap();
    let id = shard.dir.lock().route(key);
    let (t, sl) = target(s, id, key);
    let reply = s.handle(&DataReq::MakeupGet { t, key }.encode()).unwrap();
    let _ = sl;
    let (h, r) = head(&reply);
    match h.status {
        Status::Ok => Some(
            crate::layout::BlockFront::parse(&reply[3..])
                .unwrap()
                .value
                .to_vec(),
        ),
        Status::NotFound => None,
        other => panic!("get {key}: {other:?} {}", r.remaining()),
    }
}

#[test]
fn writes_during_a_rebuild_are_buffered_then_applied() {
    let (_c, _rt, s) = node();
    let shard = s.shard(0).unwrap().unwrap();
    let mut w = WireWriter::new();
    w.u8(op::REGISTER).u16(0);
    assert_eq!(head(&s.handle(&w.finish()).unwrap()).0.status, Status::Ok);
    for k in 1..=6u64 {
        assert_eq!(head(&insert(&s, k, b"old")).0.status, Status::Ok);
    }
    // The table stops at s_stop; the job has not run yet. Hold the job
    // flag so that the requests below (which kick the job once every
    // compute node has seen PRE_RESIZE) cannot start it before the test does.
    wait_until(Duration::from_secs(10), "a job is still running", || {
        shard
            .job_active
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    });
    let t0 = shard.table(0).unwrap();
    t0.state.store(state::REBUILDING, Ordering::Release);
    shard.resize_pending.store(true, Ordering::Release);
    let buffered = insert(&s, 100, b"new");
    let (h, mut r) = head(&buffered);
    assert_eq!(h.status, Status::Buffered);
    assert!(h.pre_resize(), "replies carry PRE_RESIZE while resizing");
    let (ticket, applied) = (r.u64().unwrap(), r.u64().unwrap());
    assert_eq!(applied, 0);
    let (t, sl) = target(&s, 0, 3);
    let del = s
        .handle(
            &DataReq::Delete {
                t,
                slot: sl,
                key: 3,
            }
            .encode(),
        )
        .unwrap();
    let (h, mut r) = head(&del);
    assert_eq!(h.status, Status::Buffered);
    let del_ticket = r.u64().unwrap();
    // Updates are served at once, GETs too; the buffered writes are not
    // visible yet.
    let (t, sl) = target(&s, 0, 2);
    let up = s
        .handle(
            &DataReq::Update {
                t,
                slot: sl,
                key: 2,
                value: b"upd",
            }
            .encode(),
        )
        .unwrap();
    assert_eq!(head(&up).0.status, Status::Ok);
    assert_eq!(get(&s, 100), None);
    assert_eq!(get(&s, 3), Some(b"old".to_vec()));
    let mut w = WireWriter::new();
    w.u8(op::RESULT).u16(0).u64(ticket);
    let pending = s.handle(&w.finish()).unwrap();
    assert_eq!(head(&pending).0.status, Status::Recovering);
    // Run the rebuild (a split) and wait for it.
    let old_epoch = t0.epoch.load(Ordering::Acquire);
    let old_target = target(&s, 0, 1).0;
    assert_eq!(shard.stats.splits.load(Ordering::Relaxed), 0);
    shard.job_active.store(false, Ordering::Release);
    shard.kick();
    wait_until(
        Duration::from_secs(10),
        "the rebuild did not finish",
        || shard.applied.load(Ordering::Acquire) != 0,
    );
    assert_eq!(shard.stats.splits.load(Ordering::Relaxed), 1);
    assert_eq!(shard.stats.start_stop_fill.load(Ordering::Relaxed), 1);
    // Both halves are new tables sized for their keys; table 0 is retired.
    assert_eq!(shard.live_tables().len(), 2);
    assert!(shard.table(0).is_none());
    let after = *shard.stats.after_resize.lock();
    assert_eq!((after.resizes, after.last_keys), (1, 6));
    for (tk, want) in [(ticket, Status::Ok), (del_ticket, Status::Ok)] {
        let mut w = WireWriter::new();
        w.u8(op::RESULT).u16(0).u64(tk);
        assert_eq!(head(&s.handle(&w.finish()).unwrap()).0.status, want);
    }
    assert_eq!(get(&s, 100), Some(b"new".to_vec()));
    assert_eq!(get(&s, 3), None);
    assert_eq!(get(&s, 2), Some(b"upd".to_vec()));
    for k in [1u64, 4, 5, 6] {
        assert_eq!(get(&s, k), Some(b"old".to_vec()), "key {k}");
    }
    // A request naming the split table (retired) is told STALE.
    let stale = Target {
        epoch: old_epoch,
        ..old_target
    };
    let r = s
        .handle(&DataReq::Get { t: stale, slot: 0 }.encode())
        .unwrap();
    assert_eq!(head(&r).0.status, Status::Stale);
    // The new view is published with its directory.
    let v = crate::publish::ViewDesc::decode(
        &shard
            .ctl
            .mem
            .read_vec(
                crate::layout::ctl::BODY,
                shard
                    .ctl
                    .mem
                    .load_u64(crate::layout::ctl::BODY_LEN)
                    .unwrap() as usize,
            )
            .unwrap(),
    )
    .unwrap();
    assert_eq!((v.global_depth, v.tables.len()), (1, 2));
    assert_eq!(
        shard.ctl.mem.load_u64(crate::layout::ctl::APPLIED).unwrap(),
        1
    );
}

fn result_status(s: &Arc<NodeServer>, ticket: u64) -> Result<Status, String> {
    let mut w = WireWriter::new();
    w.u8(op::RESULT).u16(0).u64(ticket);
    match s.handle(&w.finish()) {
        Ok(r) => Ok(head(&r).0.status),
        Err(e) => Err(e.to_string()),
    }
}

#[test]
fn outcomes_wait_for_their_client_however_many_rebuilds_pass() {
    let (_c, _rt, s) = node();
    let shard = s.shard(0).unwrap().unwrap();
    shard.settle_ticket(7, Ok(super::shard::Outcome::Inserted), false);
    shard.settle_ticket(8, Ok(super::shard::Outcome::Exists), false);
    // Many rebuilds complete before the client asks (small tables split
    // in quick succession): the outcomes are still there.
    for _ in 0..20 {
        shard.applied.fetch_add(1, Ordering::AcqRel);
        shard.forget_old_outcomes(dmkv_transport::time::Instant::now());
    }
    assert_eq!(result_status(&s, 7), Ok(Status::Ok));
    // Taken once.
    assert!(result_status(&s, 7).is_err());
    // Past the time any client could still ask, it is forgotten.
    shard.forget_old_outcomes(
        dmkv_transport::time::Instant::now() + super::shard::OUTCOME_KEEP + Duration::from_secs(1),
    );
    let gone = result_status(&s, 8);
    assert!(
        gone.as_ref()
            .is_err_and(|e| e.contains("unknown or forgotten")),
        "{gone:?}"
    );
}

/// Invariant 13 of docs/outback.md: the seeds array compute nodes fetch
/// one-sided holds, for every unlocked bucket, the seed of its control
/// word, through re-seeds (checked after every insert, while a rebuild
/// may run beside) and rebuilds (splits into new tables).
#[test]
fn seeds_array_follows_the_control_words() {
    let (_c, _rt, s) = node();
    let shard = s.shard(0).unwrap().unwrap();
    // Checks every bucket that stays unlocked and unchanged while its byte
    // is read (a seqlock read of the control word around it); returns how
    // many buckets were compared.
    let check = || {
        let mut compared = 0;
        for t in shard.live_tables() {
            for b in 0..t.buckets {
                let ctl = || t.region.mem.load_u64(t.layout.control(b)).unwrap();
                let c1 = crate::layout::ControlWord(ctl());
                let mut byte = [0u8];
                t.region.mem.read(t.layout.seed(b), &mut byte).unwrap();
                if !c1.locked() && ctl() == c1.0 {
                    assert_eq!(byte[0], c1.seed(), "table {} bucket {b}", t.id);
                    compared += 1;
                }
            }
        }
        compared
    };
    let mut compared = 0;
    for key in 1..=64u64 {
        let id = shard.dir.lock().route(key);
        let (t, _) = target(&s, id, key);
        let reply = s
            .handle(
                &DataReq::Insert {
                    t,
                    key,
                    value: b"v",
                    upsert: false,
                }
                .encode(),
            )
            .unwrap();
        // STALE: a rebuild retired the table between route and request;
        // the key is left out (the check is about seeds only).
        let st = head(&reply).0.status;
        assert!(
            matches!(st, Status::Ok | Status::Buffered | Status::Stale),
            "insert {key}: {st:?}"
        );
        compared += check();
    }
    // Let every rebuild finish (no job, no table outside NORMAL).
    wait_until(Duration::from_secs(20), "rebuilds did not settle", || {
        !shard.job_active.load(Ordering::Acquire)
            && !shard.resize_pending.load(Ordering::Acquire)
            && shard
                .live_tables()
                .iter()
                .all(|t| t.state.load(Ordering::Acquire) == state::NORMAL)
    });
    assert!(
        shard.stats.reseeds.load(Ordering::Relaxed) > 0,
        "no re-seed happened"
    );
    assert!(shard.live_tables().len() > 1, "no split happened");
    compared += check();
    assert!(compared > 0);
}

/// Polls `done` every millisecond until it holds; fails with `what` after
/// `limit` (these tests run the memory node's rebuild job on its own
/// thread, on the local transport).
fn wait_until(limit: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}
