//! `trainlet store`: a standalone c10d TCPStore server on one event loop
//! (as torch's libuv server), until SIGTERM/SIGINT/SIGHUP/SIGQUIT.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::Error;
use crate::cli::StoreArgs;
use crate::process::signals::{self, SysEvent};
use crate::store::{Budget, StoreServer, bind_listener};
use crate::{exit, sys};

/// Serve until a stop signal.
pub fn main(args: &StoreArgs) -> Result<u8, Error> {
    // One event loop, as torch's libuv server and the agent's StoreLoop.
    let rt = crate::process::event_loop()?;
    let mut events = signals::start().map_err(|e| Error::Start(crate::process::StartError::Signals(e)))?;
    rt.block_on(async {
        let cancel = CancellationToken::new();
        let listener = bind_listener(args.host, args.port)?;
        let (memory, _) = crate::config::store_memory(
            args.store_memory.as_deref(),
            &crate::config::Env::from_process(),
            crate::store::default_budget(std::path::Path::new("/")),
        )?;
        let server =
            StoreServer::start(listener, Arc::new(Budget::new(memory)), cancel.child_token()).map_err(Error::Serve)?;
        // Tests and scripts read the port from this line.
        println!("trainlet store listening on {}", server.local_addr());
        tracing::info!(addr = %server.local_addr(), memory_budget = memory, "store serving");
        let sig = loop {
            match events.recv().await {
                Some(SysEvent::Signal(s)) if signals::STOP.contains(&s) => break s,
                Some(_) => {}
                None => break libc::SIGTERM,
            }
        };
        tracing::info!(signal = %sys::signal_name(sig), "store stopping");
        server.shutdown().await;
        Ok(exit::SUCCESS)
    })
}
