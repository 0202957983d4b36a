//! The storage node: a tokio server speaking the storage protocol to servers and the admin
//! protocol to operators, over plaintext or mutual TLS.
pub mod admin;
pub mod connection;
pub mod protocol;
pub mod retention;
pub mod secrets;
pub mod server;
pub mod tls;
