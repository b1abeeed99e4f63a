package outbox

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"math/bits"
	"time"
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
// The slots only choose where a claim looks first; they guarantee
// nothing, and order does not rest on them: every claim checks each
// aggregate's order as before, so two dispatchers that disagree on the
// slots for a moment (while one joins or leaves) deliver in order all the
// same. A dispatcher whose own slots have nothing due claims from all of
// them, so that the backlog of a dispatcher that is slow, or that stopped
// without its connection closing yet, is taken by the others.
//
// The locks live as long as their connection: a dispatcher that stops, or
// whose process dies, releases its slots when the server sees the
// connection close, and the others take them at their next look, every
// slotPeriod. The lock keys are the table's identity (its oid) and the
// slot number (0 to 63), and 64 for the shared lock that counts the
// dispatchers.
//
// On SQLite a single writer drains the database, and there are no slots.

const (
	slotCount = 64
	allSlots  = ^uint64(0)
	// slotPeriod is how often a running dispatcher looks at who holds
	// which slots, and takes or gives back slots to hold its share.
	slotPeriod = 250 * time.Millisecond
)

// slotLocks is how an engine lets dispatchers agree on slots: locks held
// by a session, counted across sessions.
type slotLocks interface {
	// slotOf is the expression for the slot (0 to 63) of a row of the
	// records table under alias a.
	slotOf(a string) string
	// join takes on conn the shared lock that counts a dispatcher of t,
	// and returns the namespace of t's slot locks.
	join(ctx context.Context, conn *sql.Conn, t tables) (ns int64, err error)
	// holders returns how many dispatchers hold the shared lock of ns,
	// the slots that conn holds, and those that other sessions hold.
	holders(ctx context.Context, conn *sql.Conn, ns int64) (members int, mine, others uint64, err error)
	// lock tries to take slot on conn without waiting, and reports
	// whether it did.
	lock(ctx context.Context, conn *sql.Conn, ns int64, slot int) (bool, error)
	// unlock gives slot back.
	unlock(ctx context.Context, conn *sql.Conn, ns int64, slot int) error
}

// slotShare is how many slots each of n dispatchers holds at most.
func slotShare(n int) int { return (slotCount + n - 1) / max(n, 1) }

// slotsNeed is how many connections of its pool a Run that holds slots
// needs at least: one for the claims, one for the slot locks, and one for
// the listener if it listens.
func (d *Dispatcher) slotsNeed() int {
	if d.listen {
		return 3
	}
	return 2
}

// holdSlots keeps this dispatcher's share of the slots until ctx ends,
// on a connection of its own that it discards then, which releases them.
// It does nothing on an engine without slot locks, or for a pool that
// cannot spare the connection; while it holds no slots (joining, or after
// losing its connection) claims look at all of them.
func (d *Dispatcher) holdSlots(ctx context.Context) {
	locks := d.d.slotLocks()
	if locks == nil || !d.holding.CompareAndSwap(false, true) {
		return // no slots here, or another Run of this dispatcher holds them
	}
	defer d.holding.Store(false)
	pool, err := d.db.DB()
	if err != nil {
		return
	}
	if n := pool.Stats().MaxOpenConnections; n != 0 && n < d.slotsNeed() {
		d.log.Info("outbox: not sharing slots with other dispatchers: the pool is too small to hold their locks",
			"max_open_connections", n, "needs", d.slotsNeed())
		return
	}
	var (
		conn *sql.Conn
		ns   int64
	)
	drop := func() {
		d.slots.Store(0)
		if conn != nil {
			discard(conn)
			conn = nil
		}
	}
	defer drop()
	for {
		wait := slotPeriod
		if conn == nil {
			conn, err = pool.Conn(ctx)
			if err == nil {
				ns, err = locks.join(ctx, conn, d.t)
			}
		}
		if err == nil {
			err = d.takeShare(ctx, locks, conn, ns)
		}
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			d.log.Warn("outbox: lost the slot locks; claiming from all slots meanwhile", "error", err, "retry_in", d.pollInterval)
			drop()
			wait = max(wait, d.pollInterval)
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
	}
}

// takeShare gives back the slots conn holds beyond this dispatcher's
// share, highest first, and takes free ones up to it, lowest first; then
// claims look first at what it holds.
func (d *Dispatcher) takeShare(ctx context.Context, locks slotLocks, conn *sql.Conn, ns int64) error {
	members, mine, others, err := locks.holders(ctx, conn, ns)
	if err != nil {
		return err
	}
	share := slotShare(members)
	for s := slotCount - 1; s >= 0 && bits.OnesCount64(mine) > share; s-- {
		if mine&(1<<s) != 0 {
			mine &^= 1 << s
			d.slots.Store(mine) // stop looking there before another takes it
			if err := locks.unlock(ctx, conn, ns, s); err != nil {
				return err
			}
		}
	}
	for s := 0; s < slotCount && bits.OnesCount64(mine) < share; s++ {
		if (mine|others)&(1<<s) != 0 {
			continue
		}
		ok, err := locks.lock(ctx, conn, ns, s)
		if err != nil {
			return err
		}
		if ok {
			mine |= 1 << s
		}
	}
	d.slots.Store(mine)
	return nil
}

// ownSlots returns the slots a claim should look at first: 0 when it
// should look at all of them at once (this dispatcher holds none, or all).
func (d *Dispatcher) ownSlots() uint64 {
	if s := d.slots.Load(); s != allSlots {
		return s
	}
	return 0
}

// discard closes conn's session instead of handing it back to the pool,
// which ends the session's locks.
func discard(conn *sql.Conn) {
	_ = conn.Raw(func(any) error { return driver.ErrBadConn })
	_ = conn.Close()
}
