package outbox

import (
	"context"
	"time"
)

// Run dispatches until ctx ends, then returns nil. It claims again at once
// while batches come back full, and otherwise waits for the poll interval
// (see [WithPollInterval]) or a [Dispatcher.Notify], whichever comes first.
// Errors (a lost connection, a server restart) are logged and retried at
// the poll interval: Run recovers by itself.
//
// When ctx ends, the batch in flight is published and settled before Run
// returns; no new batch is claimed.
func (d *Dispatcher) Run(ctx context.Context) error {
	work := context.WithoutCancel(ctx)
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-timer.C:
		case <-d.wake:
		}
		if ctx.Err() != nil {
			return nil
		}
		n, _, err := d.dispatch(work)
		wait := d.pollInterval
		switch {
		case err != nil:
			d.log.Error("outbox: dispatch failed; retrying", "error", err, "in", wait)
		case n == d.batchSize:
			wait = 0
		}
		if !timer.Stop() {
			select {
			case <-timer.C:
			default:
			}
		}
		timer.Reset(wait)
	}
}

// Notify wakes [Dispatcher.Run] to look for due rows now instead of at its
// next poll. It never blocks, and bursts of calls coalesce into one
// wake-up.
func (d *Dispatcher) Notify() {
	select {
	case d.wake <- struct{}{}:
	default:
	}
}
