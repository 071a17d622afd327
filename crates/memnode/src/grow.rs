//! A pool that grows: registered memory in segments, added on demand.
//!
//! RDMA memory is registered in regions of a fixed length, so a pool that
//! must outgrow its first estimate registers further regions. A
//! [`GrowingPool`] owns segment regions `NAME`, `NAME.1`, `NAME.2`, … on
//! one node and hands out offsets in one *global* offset space: segment `i`
//! covers `[i * span, i * span + len_i)` with `len_i <= span`, so an offset
//! names its segment by `offset / span` and the position in it by
//! `offset % span`. Segment 0 is sized by the caller (the estimate from the
//! expected load); every later one is twice the one before (so a pool that
//! started far too small needs few segments), at most `span` and at most
//! what is left of the pool's byte limit. A client resolves
//! segments it has not seen yet by name, once, with [`RemoteSegments`].
//!
//! Allocation is a bump over the newest segment; the tail of a segment too
//! short for a request is left unused (the request goes to a new segment).
//! Nothing is ever freed back to the pool (the engines that use it keep
//! their own free lists of the blocks they carve).

use crate::alloc::AllocError;
use crate::runtime::{NodeRuntime, Region};
use dmkv_transport::{Endpoint, NodeId, RemoteAddr, RemoteRegion, TransportError};
use parking_lot::{Mutex, RwLock};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

/// Name of segment `index` of the pool `name`: segment 0 keeps the pool's
/// own name.
pub fn segment_name(name: &str, index: u64) -> String {
    if index == 0 {
        name.to_string()
    } else {
        format!("{name}.{index}")
    }
}

/// Shape of a growing pool's offset space, shared by server and clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentShape {
    /// Bytes of offset space per segment (a power of two).
    pub span: u64,
    /// Most segments the pool may have (what the engine's pointers address).
    pub max_segments: u64,
}

impl SegmentShape {
    /// Segment of a global offset.
    pub fn segment(&self, offset: u64) -> u64 {
        offset / self.span
    }
}

/// The server side: segment regions on this node and a bump over the newest.
pub struct GrowingPool {
    rt: Weak<NodeRuntime>,
    name: String,
    shape: SegmentShape,
    /// Most bytes all segments together may register.
    limit: u64,
    state: Mutex<GrowState>,
}

struct GrowState {
    /// Registered segments, in order.
    segs: Vec<Region>,
    /// Next free global offset (in the newest segment).
    next: u64,
    /// Bytes handed out (after alignment), over all segments.
    handed: u64,
    /// Bytes registered, over all segments.
    registered: u64,
}

impl GrowingPool {
    /// Registers segment 0 (`first` bytes, at most `shape.span`) under
    /// `name` on `rt`. The first `reserved` bytes of segment 0 are never
    /// handed out (a superblock, a root word). All segments together
    /// register at most `limit` bytes.
    pub fn new(
        rt: &Arc<NodeRuntime>,
        name: &str,
        shape: SegmentShape,
        first: u64,
        reserved: u64,
        limit: u64,
    ) -> Result<GrowingPool, AllocError> {
        if !shape.span.is_power_of_two() || shape.max_segments == 0 {
            return Err(AllocError::BadRequest(format!(
                "segment span {} must be a power of two and segments at least 1",
                shape.span
            )));
        }
        if first > shape.span || first == 0 || reserved > first || first > limit {
            return Err(AllocError::BadRequest(format!(
                "{name}: a first segment of {first} bytes ({reserved} reserved) does not fit \
                 spans of {} bytes and a limit of {limit} bytes",
                shape.span
            )));
        }
        let seg0 = register(rt, name, first)?;
        seg0.used.store(reserved, Ordering::Relaxed);
        Ok(GrowingPool {
            rt: Arc::downgrade(rt),
            name: name.to_string(),
            shape,
            limit,
            state: Mutex::new(GrowState {
                segs: vec![seg0],
                next: reserved,
                handed: reserved,
                registered: first,
            }),
        })
    }

    /// Segment 0 (where callers keep their superblock).
    pub fn first_segment(&self) -> Region {
        self.state.lock().segs[0].clone()
    }

    pub fn shape(&self) -> SegmentShape {
        self.shape
    }

    /// Segments registered so far.
    pub fn segments(&self) -> u64 {
        self.state.lock().segs.len() as u64
    }

    /// Bytes registered so far.
    pub fn registered(&self) -> u64 {
        self.state.lock().registered
    }

    /// Bytes handed out so far (including the reserved ones).
    pub fn allocated(&self) -> u64 {
        self.state.lock().handed
    }

    /// `size` bytes aligned to `align` (a power of two): a global offset.
    /// Registers a new segment when the newest cannot hold the request.
    pub fn alloc(&self, size: u64, align: u64) -> Result<u64, AllocError> {
        if !align.is_power_of_two() || align > self.shape.span {
            return Err(AllocError::BadRequest(format!(
                "alignment {align} is not a power of two up to the segment span"
            )));
        }
        if size > self.shape.span {
            return Err(AllocError::BadRequest(format!(
                "{size} bytes exceed {}'s segment span of {} bytes",
                self.name, self.shape.span
            )));
        }
        let mut s = self.state.lock();
        loop {
            let seg = (s.segs.len() - 1) as u64;
            let base = seg * self.shape.span;
            let end = base + s.segs[seg as usize].len();
            let at = s.next.div_ceil(align) * align;
            if at + size <= end {
                let used = at + size - s.next;
                s.next = at + size;
                s.handed += used;
                s.segs[seg as usize].used.fetch_add(used, Ordering::Relaxed);
                return Ok(at);
            }
            let len = (s.segs[seg as usize].len() * 2)
                .min(self.shape.span)
                .min(self.limit - s.registered);
            if seg + 1 >= self.shape.max_segments || len < size {
                return Err(AllocError::Exhausted {
                    what: self.name.clone(),
                    capacity: s.handed,
                    requested: size,
                });
            }
            let rt = self.rt.upgrade().ok_or_else(|| {
                AllocError::BadRequest(format!("{}: the node is shutting down", self.name))
            })?;
            let region = register(&rt, &segment_name(&self.name, seg + 1), len)?;
            region.used.store(0, Ordering::Relaxed);
            s.registered += len;
            s.segs.push(region);
            s.next = (seg + 1) * self.shape.span;
        }
    }
}

fn register(rt: &NodeRuntime, name: &str, len: u64) -> Result<Region, AllocError> {
    rt.register_region(name, len as usize)
        .map_err(|e| AllocError::Exhausted {
            what: format!("{name} (registering {len} bytes: {e})"),
            capacity: 0,
            requested: len,
        })
}

/// The client side: a growing pool's segments on one node, looked up by
/// name the first time an offset in them is used.
pub struct RemoteSegments {
    node: NodeId,
    name: String,
    shape: SegmentShape,
    segs: RwLock<Vec<Option<RemoteRegion>>>,
}

impl RemoteSegments {
    /// Segment 0 must already be known (`first`, looked up at connect).
    pub fn new(node: NodeId, name: &str, shape: SegmentShape, first: RemoteRegion) -> Self {
        RemoteSegments {
            node,
            name: name.to_string(),
            shape,
            segs: RwLock::new(vec![Some(first)]),
        }
    }

    /// Segment 0.
    pub fn first(&self) -> RemoteRegion {
        self.segs.read()[0].expect("segment 0 is known from the start")
    }

    /// The address of global `offset`; looks its segment up if it is new to
    /// this client. An offset past every segment the node registered is an
    /// error from the lookup (or from the region's bounds check).
    pub async fn at(&self, ep: &Endpoint, offset: u64) -> Result<RemoteAddr, TransportError> {
        let seg = self.shape.segment(offset);
        let within = offset % self.shape.span;
        if let Some(Some(r)) = self.segs.read().get(seg as usize) {
            return Ok(r.at(within));
        }
        if seg >= self.shape.max_segments {
            return Err(TransportError::Backend(format!(
                "offset {offset:#x} is past the {} segments of {}",
                self.shape.max_segments, self.name
            )));
        }
        let r = ep
            .lookup_region(self.node, &segment_name(&self.name, seg))
            .await?;
        let mut segs = self.segs.write();
        if segs.len() <= seg as usize {
            segs.resize(seg as usize + 1, None);
        }
        segs[seg as usize] = Some(r);
        Ok(r.at(within))
    }

    /// The address of `offset` if its segment is already known.
    pub fn known_at(&self, offset: u64) -> Option<RemoteAddr> {
        let seg = self.shape.segment(offset) as usize;
        self.segs
            .read()
            .get(seg)
            .copied()
            .flatten()
            .map(|r| r.at(offset % self.shape.span))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dmkv_transport::NodeHost;
    use dmkv_transport::exec::block_on;
    use dmkv_transport::local::{LocalCluster, LocalConfig};

    #[test]
    fn grows_by_segments_that_clients_find() {
        let c = LocalCluster::new(LocalConfig::default());
        let rt = NodeRuntime::new(c.add_node(1));
        let shape = SegmentShape {
            span: 1 << 16,
            max_segments: 3,
        };
        let pool = GrowingPool::new(&rt, "p", shape, 4096, 64, 1 << 20).unwrap();
        assert_eq!(pool.alloc(1000, 64).unwrap(), 64);
        assert_eq!(pool.alloc(3000, 64).unwrap(), 1088);
        // Does not fit the rest of segment 0: segment 1 (8 KiB) starts at
        // its span.
        assert_eq!(pool.alloc(1000, 64).unwrap(), 1 << 16);
        assert_eq!(pool.segments(), 2);
        assert_eq!(pool.registered(), 4096 + 8192);
        assert_eq!(rt.stats().memory_used, 64 + 1000 + 24 + 3000 + 1000);
        assert!(matches!(
            pool.alloc(1 << 17, 8),
            Err(AllocError::BadRequest(_))
        ));
        // 9000 bytes do not fit segment 1's rest: segment 2 has 16 KiB.
        assert_eq!(pool.alloc(9000, 8).unwrap(), 2 << 16);
        assert_eq!(pool.registered(), 4096 + 8192 + 16384);
        assert!(
            matches!(pool.alloc(8000, 8), Err(AllocError::Exhausted { .. })),
            "max_segments bounds the growth"
        );
        // A byte limit bounds it too.
        let rt2 = NodeRuntime::new(c.add_node(2));
        let small = GrowingPool::new(&rt2, "q", shape, 4096, 0, 4096 + 2048).unwrap();
        assert_eq!(small.alloc(4096, 8).unwrap(), 0);
        assert_eq!(small.alloc(2048, 8).unwrap(), 1 << 16);
        assert!(matches!(
            small.alloc(8, 8),
            Err(AllocError::Exhausted { .. })
        ));

        let ep = c.fabric().endpoint(c.add_node(0).id()).unwrap();
        let first = block_on(ep.lookup_region(rt.id(), "p")).unwrap();
        let remote = RemoteSegments::new(rt.id(), "p", shape, first);
        assert!(remote.known_at(2 << 16).is_none());
        let at = block_on(remote.at(&ep, (2 << 16) + 8)).unwrap();
        block_on(ep.write(at, &[7; 8])).unwrap();
        let seg2 = rt.region("p.2").unwrap();
        assert_eq!(seg2.mem.read_vec(8, 8).unwrap(), vec![7; 8]);
        assert!(remote.known_at(2 << 16).is_some());
        assert!(block_on(remote.at(&ep, 3 << 16)).is_err());
    }
}
