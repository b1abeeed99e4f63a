package outbox

import "math"

// ClaimByRuns makes d claim by runs alone from now on, as it does for a
// poll interval after finding the oldest due events held by other
// dispatchers, so that tests can specify run claims directly.
func ClaimByRuns(d *Dispatcher) { d.runsUntil.Store(math.MaxInt64) }
