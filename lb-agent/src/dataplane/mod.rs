//! The dataplane: load, pin and attach the BPF programs, and write the maps.
//! It knows nothing about Kubernetes; it takes desired frontends and backends.
pub mod bpflog;
pub mod btf;
pub mod build;
pub mod checks;
pub mod foreign;
pub mod inspect;
pub mod loader;
pub mod maglev;
pub mod maps;
pub mod table;
pub mod upgrade;
pub mod writer;
