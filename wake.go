package outbox

import (
	"context"
	"sync"
	"time"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox/internal/dialect"
)

// Wake-ups. A dispatcher polls, but it also learns at once that events were
// committed, in three ways:
//
//   - In-process: the plugin calls the wakers of this process's dispatchers
//     (addWaker) after a write through it; inside the caller's
//     db.Transaction, whose commit no callback sees, that is before the
//     commit, and Dispatcher.Run looks again shortly; inside Transaction,
//     after the commit.
//   - Notification inside the transaction: the write asks PostgreSQL to
//     notify when its transaction commits.
//   - Notification after the commit: a notifier sends one notification,
//     from a connection of the pool, once the commit has returned, for a
//     transaction whose commit the plugin sees (GORM's default transaction
//     of a statement, the one the plugin opens under SkipDefaultTransaction,
//     Publish's outside a transaction, Transaction's; see transaction.go).
//
// The notifications never come before the events are visible. The one
// inside comes only with the commit. The notifier's follows a statement
// that wrote events even if it then reports an error, since the error may
// come from a callback after the commit: a write rolled back after its
// events were written (its commit failed, say) can cost a wake-up that
// finds nothing, but a committed one is not left without.
//
// A transaction notifies inside when the plugin cannot see its commit (the
// caller's db.Transaction, and statements nested in another's, like
// association saves), or when no other transaction of the plugin's is
// counted in flight, from its event writes until after its commit;
// otherwise the notifier does it. PostgreSQL serialises the commits of
// transactions that notify: each holds a database-wide lock from its
// notification until its commit is flushed, so eight clients that all
// notify commit one at a time and lose group commit. The notifier sends
// from outside the business transactions, once per burst, so that they
// commit side by side; a lone transaction notifies inside, where it costs
// nothing, while a separate transaction per commit cost a seventh of the
// throughput at one client in development runs (README, "Performance").
//
// A panic in another plugin's callback between the plugin's write and the
// commit leaves the transaction counted as in flight: from then on lone
// transactions leave their notification to the notifier, which costs some
// throughput and misses nothing.

// addWaker registers wake to be called after events are written through
// the plugin, for dispatchers in this process that have no notification
// listener. It returns the function that unregisters it.
func (p *OutboxPlugin) addWaker(wake func()) (remove func()) {
	key := &wake
	p.mu.Lock()
	p.wakers[key] = struct{}{}
	p.mu.Unlock()
	return func() {
		p.mu.Lock()
		delete(p.wakers, key)
		p.mu.Unlock()
	}
}

// wake nudges the in-process dispatchers; each nudge is non-blocking.
func (p *OutboxPlugin) wake() {
	p.mu.RLock()
	defer p.mu.RUnlock()
	for w := range p.wakers {
		(*w)()
	}
}

// committed wakes the dispatchers after a transaction that the plugin saw
// commit wrote events: those of this process directly, the others through
// n, unless the transaction notified at its commit itself (inside).
func (p *OutboxPlugin) committed(n *notifier, inside bool) {
	p.wake()
	if !inside && n != nil {
		n.signal()
	}
}

// notifyInside reports whether a write in a transaction whose commit the
// plugin sees asks the engine to notify at the commit, rather than leave
// it to n after the commit. It does when notifications are on and either
// there is no notifier, or no other such transaction is between its
// writes and its commit: a lone transaction notifies at no extra cost;
// among concurrent ones, the notifier keeps their commits from being
// serialised. (In the caller's transaction, whose commit the plugin does
// not see, a write always asks the engine when notifications are on.)
func (p *OutboxPlugin) notifyInside(n *notifier) bool {
	return p.notify && (n == nil || p.ownInFlight.Load() <= 1)
}

// notifierFor returns the notifier of the pool behind db's connection (a
// transaction's, if db is in one), creating it on first use, or nil when
// notifications are off, the engine has none, or GORM cannot name the pool.
func (p *OutboxPlugin) notifierFor(db *gorm.DB) *notifier {
	if !p.notify {
		return nil
	}
	d, err := dialect.For(db)
	if err != nil {
		return nil
	}
	cn, ok := d.(dialect.Notifier)
	if !ok {
		return nil
	}
	pool, err := db.DB()
	if err != nil {
		return nil
	}
	p.mu.RLock()
	n := p.notifiers[pool]
	p.mu.RUnlock()
	if n != nil {
		return n
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if n = p.notifiers[pool]; n == nil {
		t := p.tables
		n = &notifier{
			send: func(ctx context.Context) error { return cn.NotifyCommitted(ctx, pool, t) },
			gap:  notifyGap,
		}
		p.notifiers[pool] = n
	}
	return n
}

// notifyTimeout bounds one notification after a commit. A notification
// that fails or times out is not retried: it is a wake-up, not an event,
// and the dispatchers' poll finds the events anyway, as it does for any
// notification missed while a listener reconnects.
const notifyTimeout = 5 * time.Second

// notifyGap paces the notifications after commits. A dispatcher that is
// woken claims everything committed so far, and wake-ups during its claim
// coalesce into one more claim, so a faster pace would only load the
// server. In development runs of the bench's write scenario with eight
// clients, a notification per commit cost about a sixth of the write
// throughput, one per millisecond about a fourteenth, one per 5 ms nothing
// measurable. It
// delays a wake-up by 5 ms at most, and only during a burst.
const notifyGap = 5 * time.Millisecond

// notifier sends a notification after commits, coalescing bursts: at most
// one send is in flight and at most one waits, so a thousand commits during
// one send cause one more send, not a thousand. Every signal is followed by
// a send that starts after it. The sending goroutine exists only while
// there is something to send.
type notifier struct {
	send func(context.Context) error
	gap  time.Duration // the least time from the start of one send to the next

	mu      sync.Mutex
	pending bool // a signal came after the last send started
	running bool // the sending goroutine is alive
}

// signal asks for a notification after the commit that has just returned.
// It never blocks on the database.
func (n *notifier) signal() {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.pending = true
	if !n.running {
		n.running = true
		go n.loop()
	}
}

func (n *notifier) loop() {
	var last time.Time
	for {
		if wait := n.gap - time.Since(last); wait > 0 {
			time.Sleep(wait)
		}
		n.mu.Lock()
		if !n.pending {
			n.running = false
			n.mu.Unlock()
			return
		}
		n.pending = false
		n.mu.Unlock()
		last = time.Now()
		ctx, cancel := context.WithTimeout(context.Background(), notifyTimeout)
		_ = n.send(ctx) // see notifyTimeout
		cancel()
	}
}
