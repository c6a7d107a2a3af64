//! The agent's side of NodePort, LoadBalancer IPs and externalIPs, one job
//! per file: `node` (the node's addresses and interfaces, its netns, keeping
//! NodePorts away from local ephemeral ports), `nat` (the NAT table's expiry
//! and ending flows whose backend left), `healthcheck` (kube-proxy's
//! health check servers for externalTrafficPolicy Local).
mod healthcheck;
mod nat;
mod node;

pub use healthcheck::HealthChecks;
pub use nat::{Ending, NatTimeouts, count_at_start, monotonic_ns, nat_pass};
pub use node::{Addresses, interfaces_for, netns_cookie, reserve_ports, restore_device_sysctls, restore_device_sysctls_of, set_device_sysctls, unreserve_ports};
