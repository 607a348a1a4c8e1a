//! Serve mode through the agents' store, attacked with a raw store client
//! (not trainlet's): nothing without the token reads, runs, stops, hides,
//! replays or wedges anything.
