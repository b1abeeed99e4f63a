package outbox

import (
	"context"
	"errors"
	"time"

	"github.com/gorm-outbox/outbox/internal/dialect"
)

// WithListen sets whether [Dispatcher.Run] listens for the notifications
// that writes send when they commit (see [WithNotify]) and
// dispatches at once, instead of only polling (default true). Listening
// holds one connection of the *gorm.DB's pool for the lifetime of Run and
// reconnects by itself when it drops; the poll interval stays as a
// fallback. Give the pool at least one connection more than the Runs that
// listen on it; a pool limited to one connection is never listened on,
// since listening would hold the connection every claim needs. On SQLite,
// or with a driver other than pgx, Run is woken in-process instead, by
// writes through the plugin registered on the same *gorm.DB.
func WithListen(enabled bool) DispatcherOption {
	return func(d *Dispatcher) error {
		d.listen = enabled
		return nil
	}
}

// followUp is how soon Run looks again after an in-process wake-up that
// found nothing: the wake-up may have come from a write whose explicit
// transaction had not committed yet. While the looks find nothing, each
// waits twice as long as the one before, up to the poll interval: on
// MySQL a claim passes by rows not committed yet, where SQLite's waits
// for the writer's commit.
const followUp = 20 * time.Millisecond

// Run dispatches until ctx ends, then returns nil. It claims again at once
// while claims stop for want of room in the batch (more may be due), and
// otherwise waits for a wake-up: a notification from a committing
// transaction (see [WithListen]), a [Dispatcher.Notify], or the poll
// interval (see [WithPollInterval]), whichever comes first. Bursts of
// wake-ups coalesce: a thousand commits during one batch cause one more
// claim, not a thousand.
//
// Any number of Runs, in any number of processes, may share a table;
// each claim checks each aggregate's order itself. On PostgreSQL, Run
// listens on a connection of its own, so dispatchers must reach the
// server directly or through a pooler in session mode (LISTEN does not
// work through a pooler in transaction mode; Run then polls).
//
// Errors (a lost connection, a server restart) are logged and retried at
// the poll interval: Run recovers by itself. When ctx ends, the batch in
// flight is published and settled before Run returns; no new batch is
// claimed.
func (d *Dispatcher) Run(ctx context.Context) error {
	listenCtx, stopListening := context.WithCancel(ctx)
	defer stopListening()
	if d.listen {
		go d.listenLoop(listenCtx)
	} else {
		d.wakeInProcess(listenCtx)
	}
	work := context.WithoutCancel(ctx)
	timer := time.NewTimer(0)
	defer timer.Stop()
	var follow time.Duration // the last follow-up's wait, while they find nothing
	for {
		woken := false
		select {
		case <-ctx.Done():
			return nil
		case <-timer.C:
		case <-d.wake:
			woken = true
		}
		if ctx.Err() != nil {
			return nil
		}
		r, err := d.Dispatch(work)
		wait := d.pollInterval
		switch {
		case err != nil:
			d.log.Error("outbox: dispatch failed; retrying", "error", err, "retry_in", wait)
		case r.More:
			wait = 0
		case r.Claimed == 0 && woken && d.inProcess.Load():
			follow = followUp
			wait = min(wait, follow)
		case r.Claimed == 0 && follow > 0 && 2*follow < wait:
			follow *= 2
			wait = follow
		}
		if r.Claimed > 0 || err != nil {
			follow = 0
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

// listenLoop keeps a notification listener up until ctx ends, reconnecting
// after failures. Where notifications are not supported it falls back to
// in-process wake-ups.
func (d *Dispatcher) listenLoop(ctx context.Context) {
	first := min(d.pollInterval, time.Second)
	backoff := first
	for ctx.Err() == nil {
		started := time.Now()
		err := d.d.Listen(ctx, d.db, d.t, d.Notify)
		if ctx.Err() != nil {
			return
		}
		if errors.Is(err, dialect.ErrNoListen) {
			if err != dialect.ErrNoListen {
				d.log.Warn("outbox: not listening for notifications; polling, and woken by writes of this process", "error", err)
			}
			d.wakeInProcess(ctx)
			return
		}
		if time.Since(started) > time.Minute {
			backoff = first
		}
		d.log.Warn("outbox: notification listener lost; polling meanwhile", "error", err, "reconnect_in", backoff)
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, time.Minute)
	}
}

// wakeInProcess subscribes Run to the writes made through the plugin on the
// same *gorm.DB, until ctx ends.
func (d *Dispatcher) wakeInProcess(ctx context.Context) {
	w, ok := wakerOf(d.db)
	if !ok {
		return
	}
	d.inProcess.Store(true)
	remove := w.addWaker(d.Notify)
	go func() {
		<-ctx.Done()
		remove()
		d.inProcess.Store(false)
	}()
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
