"""Where replicas and ranks meet: the replicas' rounds and threads, the collectives across processes, their checks, and the synchronizer of a synchronized call."""
