//! Where `connect` finds the node state that `serve` created in this
//! process. ScaleStore is symmetric: a node's compute threads use its cache
//! and translation table directly (the local hot path), so the issuing side
//! must reach the serving side's memory, and the engine interface passes
//! only names. This process-wide table, keyed by instance and node, is the
//! one global of the crate; it holds weak references, so it never keeps a
//! node alive.

use crate::node::ScaleNode;
use dmkv_transport::NodeId;
use parking_lot::Mutex;
use std::sync::{Arc, Weak};

type Entry = (String, NodeId, Weak<ScaleNode>);

static NODES: Mutex<Vec<Entry>> = Mutex::new(Vec::new());

pub fn register(instance: &str, id: NodeId, node: &Arc<ScaleNode>) {
    let mut t = NODES.lock();
    t.retain(|(i, n, w)| w.strong_count() > 0 && !(i == instance && *n == id));
    t.push((instance.to_string(), id, Arc::downgrade(node)));
}

pub fn lookup(instance: &str, id: NodeId) -> Option<Arc<ScaleNode>> {
    NODES
        .lock()
        .iter()
        .find(|(i, n, _)| i == instance && *n == id)
        .and_then(|(_, _, w)| w.upgrade())
}

/// Diagnostic dump of every node of `instance` in this process.
pub fn debug_dump(instance: &str) -> String {
    let nodes: Vec<Arc<ScaleNode>> = NODES
        .lock()
        .iter()
        .filter(|(i, _, _)| i == instance)
        .filter_map(|(_, _, w)| w.upgrade())
        .collect();
    nodes.iter().map(|n| n.debug_dump()).collect()
}
