package outbox

// ClaimByRuns makes d's claims take runs alone, as they do to top up a
// batch whose window held rows back, so that tests can specify run claims
// directly.
func ClaimByRuns(d *Dispatcher) { d.runsOnly = true }

// ClaimByShard makes d's next claim read shard s (0 to 7) only, as a
// claim does after other dispatchers held its window back.
func ClaimByShard(d *Dispatcher, s int) { d.shard.Store(int32(s) + 1) }
