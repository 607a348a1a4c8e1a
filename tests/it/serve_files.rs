//! Serve mode's files and output: a run cannot plant code for the next
//! through the file cache, and one endless line cannot grow an agent.
