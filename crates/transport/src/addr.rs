//! Remote addresses: a region on a node, guarded by an access key.

use std::fmt;

/// A node of the cluster. Memory nodes, compute nodes and symmetric nodes all
/// have one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u16);

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "n{}", self.0)
    }
}

/// A registered memory region, unique within its node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegionId(pub u32);

impl fmt::Display for RegionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "r{}", self.0)
    }
}

/// The key handed out when a region is registered. Every one-sided access
/// presents it; a wrong key is refused (like an RDMA rkey).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AccessKey(pub u64);

/// What a client needs to address a registered region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteRegion {
    pub node: NodeId,
    pub id: RegionId,
    pub key: AccessKey,
    /// Size in bytes; accesses beyond it are refused.
    pub len: u64,
}

impl RemoteRegion {
    /// The address `offset` bytes into this region (not checked here: every
    /// access is checked against `len` by the backend).
    pub fn at(&self, offset: u64) -> RemoteAddr {
        RemoteAddr {
            node: self.node,
            region: self.id,
            key: self.key,
            offset,
        }
    }
}

/// One remote byte address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteAddr {
    pub node: NodeId,
    pub region: RegionId,
    pub key: AccessKey,
    pub offset: u64,
}

impl RemoteAddr {
    pub fn offset_by(self, bytes: u64) -> RemoteAddr {
        RemoteAddr {
            offset: self.offset + bytes,
            ..self
        }
    }
}

/// A service registered on a node, addressed by RPCs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ServiceId(pub u32);

impl ServiceId {
    /// The directory every node serves: it resolves service and region names.
    pub const DIRECTORY: ServiceId = ServiceId(0);
}
