//! The memory node trusts nothing a client sends: out-of-range shards,
//! tables, buckets and slots, oversized values and malformed payloads get
//! error replies, and the store works on afterwards.

mod common;

use dmkv_outback::proto::{DataReq, ReplyHead, Status, Target, op};
use dmkv_outback::server::session::Session;
use dmkv_transport::exec::block_on;
use dmkv_transport::{ErrorCode, TransportError, WireReader, WireWriter};

#[test]
fn bad_indices_get_error_replies() {
    let d = common::deploy_with(common::small_tables(), 3, 1);
    let ep = d.endpoint(0);
    let node = d.runtimes[0].id();
    let svc = block_on(ep.lookup_service(node, &d.args.name("op"))).unwrap();
    let call = |payload: Vec<u8>| block_on(ep.call(node, svc, payload));
    let good = Target {
        shard: 0,
        table: 0,
        epoch: 1,
        bucket: 0,
        compute: 1,
    };
    let malformed = |r: Result<Vec<u8>, TransportError>, what: &str| match r {
        Err(TransportError::Remote { error, .. }) if error.code == ErrorCode::Malformed => {}
        other => panic!("{what}: want a malformed-request error, got {other:?}"),
    };
    // The table the store starts with has 2 buckets of 4 slots.
    let bad_bucket = Target { bucket: 2, ..good };
    let far_bucket = Target {
        bucket: u32::MAX,
        ..good
    };
    let bad_shard = Target { shard: 3, ..good };
    let bad_table = Target {
        table: 1_000_000,
        ..good
    };
    for (t, what) in [
        (bad_bucket, "bucket past the end"),
        (far_bucket, "bucket u32::MAX"),
        (bad_shard, "shard past the end"),
        (bad_table, "table never created"),
    ] {
        malformed(call(DataReq::Get { t, slot: 0 }.encode()), what);
        malformed(call(DataReq::MakeupGet { t, key: 9 }.encode()), what);
        malformed(
            call(
                DataReq::Insert {
                    t,
                    key: 9,
                    s: Session::NONE,
                    value: b"v",
                    upsert: false,
                }
                .encode(),
            ),
            what,
        );
        malformed(
            call(
                DataReq::Update {
                    t,
                    slot: 0,
                    key: 9,
                    s: Session::NONE,
                    value: b"v",
                }
                .encode(),
            ),
            what,
        );
        malformed(
            call(
                DataReq::Delete {
                    t,
                    slot: 0,
                    key: 9,
                    s: Session::NONE,
                }
                .encode(),
            ),
            what,
        );
    }
    malformed(call(DataReq::Get { t: good, slot: 4 }.encode()), "slot 4");
    malformed(
        call(DataReq::Get { t: good, slot: 255 }.encode()),
        "slot 255",
    );
    malformed(
        call(
            DataReq::Update {
                t: good,
                slot: 7,
                key: 9,
                s: Session::NONE,
                value: b"v",
            }
            .encode(),
        ),
        "update slot 7",
    );
    malformed(
        call(
            DataReq::Delete {
                t: good,
                slot: 4,
                key: 9,
                s: Session::NONE,
            }
            .encode(),
        ),
        "delete slot 4",
    );
    let huge = vec![0u8; dmkv_outback::CAPS.max_value_len + 1];
    malformed(
        call(
            DataReq::Insert {
                t: good,
                key: 9,
                s: Session::NONE,
                value: &huge,
                upsert: true,
            }
            .encode(),
        ),
        "oversized value",
    );
    // A wrong epoch is not an error: it is how stale locators are told.
    let stale = call(
        DataReq::Get {
            t: Target { epoch: 77, ..good },
            slot: 0,
        }
        .encode(),
    )
    .unwrap();
    let head = ReplyHead::read(&mut WireReader::new(&stale)).unwrap();
    assert_eq!(head.status, Status::Stale);
    // Truncated and over-long payloads and unknown ops.
    let full = DataReq::Get { t: good, slot: 1 }.encode();
    for cut in 1..full.len() {
        malformed(call(full[..cut].to_vec()), "truncated GET");
    }
    let mut long = full.clone();
    long.push(0);
    malformed(call(long), "GET with a trailing byte");
    malformed(call(vec![200]), "unknown op");
    let mut w = WireWriter::new();
    w.u8(op::LOAD).u16(0).u32(u32::MAX);
    malformed(call(w.finish()), "LOAD with a hostile count");
    let mut w = WireWriter::new();
    w.u8(op::LOAD).u16(0).u32(1).u64(5).bytes(&huge);
    malformed(call(w.finish()), "LOAD of an oversized value");
    // Op 7 was RESULT (outcomes of buffered writes, asked later); writes
    // during a resize are answered at once now, and the op is unknown.
    let mut w = WireWriter::new();
    w.u8(7).u16(0).u64(12345);
    assert!(call(w.finish()).is_err(), "the retired RESULT op");
    for o in [op::TAKEOVER, op::BUILD, op::REGISTER] {
        let mut w = WireWriter::new();
        w.u8(o).u16(9);
        malformed(call(w.finish()), "shard out of range");
    }
    // A takeover of a live primary's shard is refused.
    let mut w = WireWriter::new();
    w.u8(op::TAKEOVER).u16(1);
    let r = call(w.finish()).unwrap();
    let first = ReplyHead::read(&mut WireReader::new(&r)).unwrap().status;
    assert!(
        matches!(first, Status::Refused | Status::Recovering),
        "{first:?}"
    );
    // The store still works, on every shard.
    let (_ep, store) = d.client(0).unwrap();
    block_on(async {
        for k in 1..100u64 {
            assert!(store.insert(k, &k.to_le_bytes()).await.unwrap());
        }
        for k in 1..100u64 {
            assert_eq!(store.get(k).await.unwrap(), Some(k.to_le_bytes().to_vec()));
        }
    });
    let st = block_on(d.engine.stats(&ep)).unwrap();
    assert_eq!(st["takeovers"].as_u64().unwrap(), 0, "{st}");
}
