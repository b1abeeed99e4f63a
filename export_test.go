package outbox

// ClaimByShard makes d's next claim read shard s (0 to 7) only, as a
// claim does after other dispatchers held its window back.
func ClaimByShard(d *Dispatcher, s int) { d.shard.Store(int32(s) + 1) }
