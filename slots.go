package outbox

import (
	"context"
	"errors"
	"math/bits"
	"time"

	"gorm.io/gorm"
)

// Slots: how dispatchers that Run side by side share a backlog.
//
// Every aggregate falls in one of 64 slots, by a hash of its type and id.
// Dispatchers that Run on the same PostgreSQL table split the slots between
// them, each holding its share (64 divided by their number, rounded up) as
// session advisory locks on a connection of its own, and each claims the
// oldest due events of its own slots first. A dispatcher then takes a
// backlog in the order it was written, as one dispatcher alone does,
// without finding the aggregates of its window held by the others: with
// one window for all, the second dispatcher's oldest rows are the later
// events of the aggregates the first one holds, which it may not take
// before those are delivered.
//
// The slots only choose where a claim looks first; order does not rest on
// them: every claim checks each aggregate's order as before, so two
// dispatchers that disagree on the slots for a moment (while one joins or
// leaves) deliver in order all the same. Nor does delivery: a dispatcher
// whose own slots have nothing due claims from all of them; a dispatcher
// whose claims have not come back for a lease (its pool exhausted, its
// database calls hanging) gives its slots back; and the slots of a
// dispatcher whose lock connection has been silent for a lease (its
// process frozen, its network gone, while the server keeps the session)
// are claimed by every other one as if they were its own, until the
// server ends that session.
//
// The locks live as long as their connection: a dispatcher that stops, or
// whose process dies, releases its slots when the server sees the
// connection close, and the others take them at their next look, every
// slotPeriod.
//
// On SQLite a single writer drains the database, and there are no slots.

const (
	slotCount = 64
	allSlots  = ^uint64(0)
	// slotPeriod is how often a running dispatcher looks at who holds
	// which slots, and takes or gives back slots to hold its share.
	slotPeriod = 250 * time.Millisecond
	// slotTimeout bounds each look, so that a connection that stopped
	// answering is dropped rather than waited for.
	slotTimeout = 5 * time.Second
	// slotRetryMax bounds the wait between attempts to open the lock
	// connection again after a failure.
	slotRetryMax = 30 * time.Second
)

// errNoSlots says why a dispatcher cannot hold slots where it runs.
var errNoSlots = errors.New("outbox: cannot share slots with other dispatchers")

// slotLocks is how an engine lets dispatchers agree on slots: locks held
// by a session of their own, counted across sessions.
type slotLocks interface {
	// slotOf is the expression for the slot (0 to 63) of a row of the
	// records table under alias a.
	slotOf(a string) string
	// open starts a session for the slot locks of t, outside db's pool
	// so that it never takes a connection the pool's users count on, and
	// counts it among the dispatchers of t. An error wrapping errNoSlots
	// says that it never can on db.
	open(ctx context.Context, db *gorm.DB, t tables) (slotSession, error)
}

// slotSession is a session that holds slot locks.
type slotSession interface {
	// holders returns how many dispatchers count themselves in, the slots
	// this session holds, those that other sessions hold, and of those the
	// slots of sessions that have sent nothing for at least silent.
	holders(ctx context.Context, silent time.Duration) (members int, mine, others, stale uint64, err error)
	// lock tries to take slot without waiting, and reports whether it did.
	lock(ctx context.Context, slot int) (bool, error)
	// unlock gives slot back.
	unlock(ctx context.Context, slot int) error
	// close ends the session, and with it its locks.
	close()
}

// slotShare is how many slots each of n dispatchers holds at most.
func slotShare(n int) int { return (slotCount + n - 1) / max(n, 1) }

// holdSlots keeps this dispatcher's share of the slots until ctx ends, on a
// session of its own that it closes then, which releases them. It does
// nothing on an engine or a pool without slot locks. While it holds no
// slots (joining, after losing its session, while its claims are stuck)
// claims look at all of them.
func (d *Dispatcher) holdSlots(ctx context.Context) {
	locks := d.d.slotLocks()
	if locks == nil || !d.holding.CompareAndSwap(false, true) {
		return // no slots here, or another Run of this dispatcher holds them
	}
	defer d.holding.Store(false)
	var (
		s       slotSession
		err     error
		retry   = slotPeriod
		failing bool
	)
	drop := func() {
		d.slots.Store(0)
		d.staleSlots.Store(0)
		if s != nil {
			s.close()
			s = nil
		}
	}
	defer drop()
	for {
		wait := slotPeriod
		switch {
		case d.stuck():
			if s != nil {
				d.log.Warn("outbox: a dispatch has not come back for a lease; giving the slots back to the other dispatchers")
				drop()
			}
		default:
			lookCtx, cancel := context.WithTimeout(ctx, slotTimeout)
			if s == nil {
				s, err = locks.open(lookCtx, d.db, d.t)
			}
			if err == nil {
				err = d.takeShare(lookCtx, s)
			}
			cancel()
			switch {
			case ctx.Err() != nil:
				return
			case errors.Is(err, errNoSlots):
				d.log.Info("outbox: claiming from all slots", "reason", err)
				return
			case err != nil:
				if !failing {
					d.log.Warn("outbox: cannot hold slots; claiming from all of them meanwhile", "error", err)
				}
				failing = true
				drop()
				wait, retry = retry, min(2*retry, slotRetryMax)
			default:
				if failing {
					d.log.Info("outbox: holding slots again")
				}
				failing, retry = false, slotPeriod
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
	}
}

// takeShare gives back the slots s holds beyond this dispatcher's share,
// highest first, and takes free ones up to it, lowest first; then claims
// look first at what it holds, and at the slots of silent sessions.
func (d *Dispatcher) takeShare(ctx context.Context, s slotSession) error {
	members, mine, others, stale, err := s.holders(ctx, d.lease)
	if err != nil {
		return err
	}
	share := slotShare(members)
	for slot := slotCount - 1; slot >= 0 && bits.OnesCount64(mine) > share; slot-- {
		if mine&(1<<slot) != 0 {
			mine &^= 1 << slot
			d.slots.Store(mine) // stop looking there before another takes it
			if err := s.unlock(ctx, slot); err != nil {
				return err
			}
		}
	}
	for slot := 0; slot < slotCount && bits.OnesCount64(mine) < share; slot++ {
		if (mine|others)&(1<<slot) != 0 {
			continue
		}
		ok, err := s.lock(ctx, slot)
		if err != nil {
			return err
		}
		if ok {
			mine |= 1 << slot
		}
	}
	d.slots.Store(mine)
	d.staleSlots.Store(stale)
	return nil
}

// stuck reports whether a dispatch of this dispatcher has been running for
// longer than a lease: its claims are not coming back.
func (d *Dispatcher) stuck() bool {
	since := d.dispatching.Load()
	return since != 0 && time.Since(time.Unix(0, since)) > d.lease
}

// ownSlots returns the slots a claim should look at first: those this
// dispatcher holds and those of silent sessions; 0 when it should look at
// all of them at once (it holds none, or they cover all).
func (d *Dispatcher) ownSlots() uint64 {
	held := d.slots.Load()
	if held == 0 {
		return 0
	}
	if s := held | d.staleSlots.Load(); s != allSlots {
		return s
	}
	return 0
}
