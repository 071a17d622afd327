//! The transport conformance suite over UCX, with TCP only and with shared
//! memory (plus TCP for set-up), on the loopback device; then what the
//! UCX backend adds: the cluster secret, remote keys through the control
//! channel, progress-thread CPU, and clients that vanish mid-operation.
//!
//! Every cluster lives in this process, but every byte between its nodes
//! goes through UCX (and the control channel over TCP).

#![cfg(feature = "ucx")]

use dmkv_transport::conformance::{Target, TestCluster};
use dmkv_transport::{Fabric, NodeHost, NodeId};
use dmkv_transport_ucx::{UcxCluster, UcxConfig, UcxNode, VerbPath};
use std::sync::Arc;

/// Makes clusters whose processes use `config`.
pub struct Ucx {
    pub config: fn(Vec<u8>) -> UcxConfig,
}

pub struct UcxTest {
    // The client's cluster first: it must let go of nodes before they stop.
    client: UcxCluster,
    servers: Vec<Arc<UcxNode>>,
    _server_cluster: UcxCluster,
}

fn secret() -> Vec<u8> {
    format!("test-secret-{}", rand_u64()).into_bytes()
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::Instant::now())
}

impl TestCluster for UcxTest {
    fn fabric(&self) -> Arc<dyn Fabric> {
        self.client.fabric()
    }
    fn server(&self, i: usize) -> Arc<dyn NodeHost> {
        self.servers[i].clone()
    }
    fn client(&self) -> NodeId {
        self.client.local_node()
    }
    fn crash(&self, i: usize) -> bool {
        let id = self.servers[i].id();
        self.servers[i].shutdown();
        // Wait until the client process has seen its control connection go.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !self.client.is_down(id) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        true
    }
}

impl Target for Ucx {
    fn cluster(&self, servers: usize, handler_threads: usize) -> Box<dyn TestCluster> {
        let secret = secret();
        // Servers and client use separate UCX contexts, as separate
        // processes would.
        let server_cluster = UcxCluster::new((self.config)(secret.clone()), NodeId(1000)).unwrap();
        let servers: Vec<Arc<UcxNode>> = (0..servers)
            .map(|i| {
                server_cluster
                    .serve(
                        NodeId(i as u16),
                        "127.0.0.1:0".parse().unwrap(),
                        handler_threads,
                    )
                    .unwrap()
            })
            .collect();
        let client = UcxCluster::new((self.config)(secret), NodeId(servers.len() as u16)).unwrap();
        for s in &servers {
            let id = client.connect(s.listen_addr()).unwrap();
            assert_eq!(id, s.id());
        }
        Box::new(UcxTest {
            client,
            servers,
            _server_cluster: server_cluster,
        })
    }
}

mod tcp {
    use super::*;
    dmkv_transport::conformance_tests!(Ucx {
        config: UcxConfig::tcp_loopback
    });
}

mod shm {
    use super::*;
    dmkv_transport::conformance_tests!(Ucx {
        config: UcxConfig::shm_loopback
    });
}

/// Shared memory through `ucp_get/put/atomic_op_nbx` rather than direct
/// mapped access.
mod shm_nbx {
    use super::*;
    fn config(secret: Vec<u8>) -> UcxConfig {
        UcxConfig {
            verbs: VerbPath::Ucx,
            ..UcxConfig::shm_loopback(secret)
        }
    }
    dmkv_transport::conformance_tests!(Ucx { config });
}

/// TCP through UCX's own emulation of `ucp_get/put/atomic_op_nbx` (served
/// by the node's progress thread inside UCX) rather than dmkv's messages.
mod tcp_nbx {
    use super::*;
    fn config(secret: Vec<u8>) -> UcxConfig {
        UcxConfig {
            verbs: VerbPath::Ucx,
            ..UcxConfig::tcp_loopback(secret)
        }
    }
    dmkv_transport::conformance_tests!(Ucx { config });
}
