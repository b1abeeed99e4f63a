package outbox

import (
	"context"
	"errors"
	"math/bits"
	"time"

	"gorm.io/gorm"
)

// Slots: how dispatchers that Run side by side share a backlog, when
// WithSlots turns them on.
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
// leaves) deliver in order all the same. Nor does delivery, but for pace:
// a dispatcher whose own slots have nothing due claims from all of them,
// so that one with nothing to do helps the others (one with little to do
// does not: filling its batch from the oldest rows of all slots would
// take the rows their holders are about to claim, and set every
// dispatcher on each other's aggregates again; the events of a slow
// dispatcher wait for it meanwhile, as a partition waits for its
// consumer); a dispatcher whose dispatch has not come back for two leases (its pool
// exhausted, its database calls hanging) gives its slots back; and the
// slots of a dispatcher whose lock connection has been silent for a lease
// (at least slotSilence; its process frozen, its network gone, while the
// server keeps the session) are claimed by every other one as if they
// were its own, until the server ends that session. A silent dispatcher
// still counts among the dispatchers, so the others' shares stay as they
// were, and they share its slots by the window of the oldest rows, as
// dispatchers without slots do.
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
	// slotSilence is the least time a lock session must have been idle
	// for its slots to count as those of a silent dispatcher: a live one
	// speaks every slotPeriod.
	slotSilence = 4 * slotPeriod
)

// errNoSlots says why a dispatcher cannot hold slots where it runs.
var errNoSlots = errors.New("outbox: cannot share slots with other dispatchers")

// slotLocks is how an engine lets dispatchers agree on slots: locks held
// by a session of their own, counted across sessions.
type slotLocks interface {
	// slotOf is the expression for the slot (0 to 63) of a row of the
	// records table under alias a.
	slotOf(a string) string
	// inSlots is the condition that the slot in expression slot is one
	// of a bit mask, its one argument.
	inSlots(slot string) string
	// window is windowSQL for the rows of the slots in a bit mask, among
	// a bounded number of the oldest due rows (slotScan), each with when
	// the server started (the expression serverStart). Arguments: now,
	// bound, mask, now, batch size.
	window(t tables, serverStart string) string
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
	// lock tries to take the slots of a bit mask without waiting, in one
	// statement, and returns those it took.
	lock(ctx context.Context, slots uint64) (uint64, error)
	// unlock gives the slots of a bit mask back, in one statement.
	unlock(ctx context.Context, slots uint64) error
	// close ends the session, and with it its locks.
	close()
}

// slotShare is how many slots each of n dispatchers holds at most.
func slotShare(n int) int { return (slotCount + n - 1) / max(n, 1) }

// holdSlots keeps this dispatcher's share of the slots until ctx ends, on a
// session of its own that it closes then, which releases them. It does
// nothing without WithSlots, or on an engine or a pool without slot locks. While it holds no
// slots (joining, after losing its session, while its claims are stuck)
// claims look at all of them.
func (d *Dispatcher) holdSlots(ctx context.Context) {
	locks := d.d.slotLocks()
	if !d.slotsOn || locks == nil || !d.holding.CompareAndSwap(false, true) {
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
				d.log.Warn("outbox: a dispatch has not come back for two leases; giving the slots back to the other dispatchers")
				drop()
			}
		default:
			lookCtx, cancel := context.WithTimeout(ctx, slotTimeout)
			err = nil
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
	members, mine, others, stale, err := s.holders(ctx, max(d.lease, slotSilence))
	if err != nil {
		return err
	}
	share := slotShare(members)
	var give, take uint64
	for slot := slotCount - 1; slot >= 0 && bits.OnesCount64(mine&^give) > share; slot-- {
		give |= mine & (1 << slot)
	}
	if give != 0 {
		mine &^= give
		d.slots.Store(mine) // stop looking there before another takes them
		if err := s.unlock(ctx, give); err != nil {
			return err
		}
	}
	for slot := 0; slot < slotCount && bits.OnesCount64(mine|take) < share; slot++ {
		if (mine|others)&(1<<slot) == 0 {
			take |= 1 << slot
		}
	}
	if take != 0 {
		got, err := s.lock(ctx, take)
		if err != nil {
			return err
		}
		mine |= got
	}
	d.slots.Store(mine)
	d.staleSlots.Store(stale)
	return nil
}

// stuck reports whether Run's dispatch (claim, publish, settle) has been
// running for longer than two leases: a publish ends within one, so its
// database calls are not coming back.
func (d *Dispatcher) stuck() bool {
	since := d.dispatching.Load()
	return since != 0 && time.Since(time.Unix(0, since)) > 2*d.lease
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
