package outbox

import "math"

// ClaimByRuns makes d claim by runs alone from now on, as it does for ten
// poll intervals after finding some of the oldest due events held back,
// so that tests can specify run claims directly.
func ClaimByRuns(d *Dispatcher) { d.runsUntil.Store(math.MaxInt64) }

// HeldSlots returns the slots d holds, as a bit mask (see slots.go).
func HeldSlots(d *Dispatcher) uint64 { return d.slots.Load() }

// ClaimSlots returns the slots d's claims look at first, as a bit mask; 0
// means all of them at once.
func ClaimSlots(d *Dispatcher) uint64 { return d.ownSlots() }
