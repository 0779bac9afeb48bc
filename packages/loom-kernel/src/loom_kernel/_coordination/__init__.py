"""The coordination streams: everything the runtime keeps on the journal SPI besides a
run's own journal (the run index, queues, due timers, leases and heartbeats, inboxes,
published values, snapshots), each a fold over streams of its own. It imports the
core, the SPI and the replay layer's gate names.
"""
