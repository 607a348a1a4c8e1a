//! Serve mode's front door: what an unauthenticated or careless HTTP client
//! can do to the control API (memory, connection slots, follow streams).
