package outbox

// ClaimByRuns makes d's claims take runs alone, as they do to top up a
// batch whose window held rows back, so that tests can specify run claims
// directly.
func ClaimByRuns(d *Dispatcher) { d.runsOnly = true }
