package outbox

import (
	"context"
	"errors"
	"time"
)

// errNoListen says that the engine or driver cannot deliver notifications.
var errNoListen = errors.New("outbox: notifications not supported here")

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
// transaction had not committed yet.
const followUp = 20 * time.Millisecond

// Run dispatches until ctx ends, then returns nil. It claims again at once
// while claims stop for want of room in the batch (more may be due), and
// otherwise waits for a wake-up: a notification from a committing
// transaction (see [WithListen]), a [Dispatcher.Notify], or the poll
// interval (see [WithPollInterval]), whichever comes first. Bursts of
// wake-ups coalesce: a thousand commits during one batch cause one more
// claim, not a thousand.
//
// On PostgreSQL, Runs with [WithSlots] on one table (in any number of
// processes) split its aggregates between them: 64 slots by a hash of the aggregate, each Run
// holding its share (64 divided by the number of Runs, rounded up) as
// session advisory locks, keyed by the table's oid and the slot, and
// rebalanced every 250ms as Runs come and go. Each Run's claims take the
// oldest due events of its own slots first, so that side by side they
// keep the throughput of one dispatcher draining its backlog in order,
// instead of holding back each other's aggregates; they claim from all
// slots when their own have nothing due. Order never rests on the slots:
// every claim checks it. The events of a Run that is slow but alive wait
// for it while the others have events of their own to deliver, as a
// partition waits for its consumer. A Run whose dispatch has not come back for two
// leases gives its slots back, and the slots of a Run whose lock
// connection has been silent for a lease (a frozen process) are claimed by
// the others as their own. The locks live on a connection that Run opens
// for itself, outside the *gorm.DB's pool, from the DSN the *gorm.DB was
// opened with (hooks of postgres.Config.OptionOpenDB do not apply to it),
// and closes before it returns. A *gorm.DB opened on a pool of the
// caller's (postgres.Config.Conn) or through another driver than pgx
// allows no slots: Run then claims from all of them, as DispatchOnce does
// on a dispatcher that is not running, and as a second Run of the same
// dispatcher does. Dispatchers must reach the server directly or through a
// pooler in session mode: session locks cannot work through a pooler in
// transaction mode, which Run detects only when it hands its first two
// statements to two sessions. Sessions of another role, unless it has
// pg_read_all_stats, cannot tell whether the Runs of that role are silent.
//
// Errors (a lost connection, a server restart) are logged and retried at
// the poll interval: Run recovers by itself. When ctx ends, the batch in
// flight is published and settled before Run returns; no new batch is
// claimed.
func (d *Dispatcher) Run(ctx context.Context) error {
	listenCtx, stopListening := context.WithCancel(ctx)
	slotsHeld := make(chan struct{})
	defer func() {
		stopListening()
		<-slotsHeld // the slots are released when Run returns
	}()
	go func() {
		defer close(slotsHeld)
		d.holdSlots(listenCtx)
	}()
	if d.listen {
		go d.listenLoop(listenCtx)
	} else {
		d.wakeInProcess(listenCtx)
	}
	work := context.WithoutCancel(ctx)
	timer := time.NewTimer(0)
	defer timer.Stop()
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
		d.dispatching.Store(time.Now().UnixNano())
		r, err := d.dispatch(work)
		d.dispatching.Store(0)
		wait := d.pollInterval
		switch {
		case err != nil:
			d.log.Error("outbox: dispatch failed; retrying", "error", err, "in", wait)
		case r.more:
			wait = 0
		case r.claimed == 0 && woken && d.inProcess.Load():
			wait = min(wait, followUp)
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
		err := d.d.listen(ctx, d.db, d.t, d.Notify)
		if ctx.Err() != nil {
			return
		}
		if errors.Is(err, errNoListen) {
			if err != errNoListen {
				d.log.Warn("outbox: not listening for notifications; polling, and woken by writes of this process", "reason", err)
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
	p, err := pluginOf(d.db)
	if err != nil {
		return
	}
	d.inProcess.Store(true)
	remove := p.addWaker(d.Notify)
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
