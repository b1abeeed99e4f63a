package outbox_test

import (
	"context"
	"fmt"
	"math/bits"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"gorm.io/driver/postgres"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// runner is a Run of a dispatcher that a test can stop.
type runner struct {
	d    *outbox.Dispatcher
	db   *gorm.DB
	stop context.CancelFunc
	done chan struct{}
}

// startRuns starts n dispatchers' Run with slots on b's table, each on a
// pool of its own, and stops those still running when the test ends.
func startRuns(t *testing.T, b bundle, n int, p outbox.Publisher, opts ...outbox.DispatcherOption) []*runner {
	t.Helper()
	rs := make([]*runner, n)
	for i := range rs {
		db := outboxtest.Reopen(t, b.info, nil)
		ctx, cancel := context.WithCancel(context.Background())
		r := &runner{d: newDispatcher(t, db, p, append([]outbox.DispatcherOption{outbox.WithSlots(true)}, opts...)...), db: db, stop: cancel, done: make(chan struct{})}
		go func() {
			defer close(r.done)
			mustNilNow(t, r.d.Run(ctx))
		}()
		rs[i] = r
	}
	t.Cleanup(func() {
		for _, r := range rs {
			r.stop()
			<-r.done
		}
	})
	return rs
}

// slotsSplit reports whether the runners hold disjoint sets of slots that
// cover all 64, each at most its share.
func slotsSplit(rs []*runner) bool {
	var all uint64
	share := (64 + len(rs) - 1) / len(rs)
	for _, r := range rs {
		s := outbox.HeldSlots(r.d)
		if all&s != 0 || bits.OnesCount64(s) > share {
			return false
		}
		all |= s
	}
	return all == ^uint64(0)
}

// slotLocks counts the advisory locks that dispatchers hold on b's table.
func slotLocks(t *testing.T, b bundle) int64 {
	t.Helper()
	var n int64
	mustNil(t, b.db.Raw(`SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2
		AND classid = 'outbox_records'::regclass::oid`).Scan(&n).Error)
	return n
}

func TestPostgresDispatchersRunningSideBySideSplitTheSlots(t *testing.T) {
	b := setup(t, outboxtest.Postgres, nil)
	rs := startRuns(t, b, 3, &recorder{})
	outboxtest.WaitUntil(t, func() bool { return slotsSplit(rs) }, "three dispatchers to split the 64 slots")

	rs[2].stop()
	<-rs[2].done
	outboxtest.WaitUntil(t, func() bool { return slotsSplit(rs[:2]) }, "the two left to take the slots of the one that stopped")

	for _, r := range rs[:2] {
		r.stop()
		<-r.done
	}
	outboxtest.WaitUntil(t, func() bool { return slotLocks(t, b) == 0 }, "the slot locks to be released")
}

// A dispatcher that loses the connection its slot locks live on claims
// from all slots meanwhile, and takes its share again on a new one.
func TestPostgresDispatcherTakesItsSlotsBackAfterLosingTheirConnection(t *testing.T) {
	b := setup(t, outboxtest.Postgres, nil)
	rs := startRuns(t, b, 2, &recorder{}, outbox.WithPollInterval(20*time.Millisecond))
	outboxtest.WaitUntil(t, func() bool { return slotsSplit(rs) }, "two dispatchers to split the slots")

	var victim int64
	mustNil(t, b.db.Raw(`SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2
		AND classid = 'outbox_records'::regclass::oid AND objid = 0`).Scan(&victim).Error)
	mustNil(t, b.db.Exec(`SELECT pg_terminate_backend(?)`, victim).Error)
	outboxtest.WaitUntil(t, func() bool {
		var holders struct{ Members, Others int64 }
		mustNil(t, b.db.Raw(`SELECT count(*) FILTER (WHERE objid = 64) AS members,
				count(*) FILTER (WHERE objid < 64 AND pid <> ?) AS others
			FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2
				AND classid = 'outbox_records'::regclass::oid`, victim).Scan(&holders).Error)
		return holders.Members == 2 && holders.Others == 64 && slotsSplit(rs)
	}, "the two dispatchers to split the slots again, on a new connection")
}

// The slot locks live on a connection of their own, outside the pool: a
// Run on a pool of one connection holds slots, and delivers.
func TestPostgresRunHoldsSlotsOutsideItsPool(t *testing.T) {
	b := setup(t, outboxtest.Postgres, nil)
	publishN(t, b.db, "a", 5)
	rec := &recorder{}
	r := startRuns(t, b, 1, rec, outbox.WithPollInterval(10*time.Millisecond))[0]
	pool, err := r.db.DB()
	mustNil(t, err)
	pool.SetMaxOpenConns(1)
	outboxtest.WaitUntil(t, func() bool { return len(rec.acceptedIDs()) == 5 }, "the five events")
	outboxtest.WaitUntil(t, func() bool { return outbox.HeldSlots(r.d) == ^uint64(0) }, "the only dispatcher to hold every slot")
}

// The slots of a session that has sent nothing for a lease (a dispatcher
// whose process is frozen while the server keeps its session) are claimed
// by the other dispatchers too, until it speaks again.
func TestPostgresDispatcherClaimsTheSlotsOfASilentOne(t *testing.T) {
	b := setup(t, outboxtest.Postgres, nil)
	ctx := context.Background()
	frozen, err := pgx.Connect(ctx, b.info.DSN)
	mustNil(t, err)
	defer frozen.Close(ctx)
	_, err = frozen.Exec(ctx, `SELECT pg_advisory_lock_shared('outbox_records'::regclass::oid::int4, 64),
		pg_advisory_lock('outbox_records'::regclass::oid::int4, s) FROM generate_series(0, 31) s`)
	mustNil(t, err)

	const lease = 500 * time.Millisecond
	r := startRuns(t, b, 1, &recorder{}, outbox.WithLease(lease), outbox.WithPublishTimeout(lease/5))[0]
	const upper uint64 = 0xffffffff00000000
	outboxtest.WaitUntil(t, func() bool { return outbox.HeldSlots(r.d) == upper }, "the dispatcher to take the free half")
	outboxtest.WaitUntil(t, func() bool { return outbox.ClaimSlots(r.d) == 0 }, "the dispatcher to claim the silent session's half too")
	_, err = frozen.Exec(ctx, `SELECT 1`)
	mustNil(t, err)
	outboxtest.WaitUntil(t, func() bool { return outbox.ClaimSlots(r.d) == upper }, "the dispatcher to leave the half whose holder spoke again")
}

// A dispatcher whose dispatch has not come back for a lease (here: its
// pool's only connection is taken) gives its slots back to the others,
// and takes its share again once it dispatches.
func TestPostgresStuckDispatcherGivesItsSlotsBack(t *testing.T) {
	b := setup(t, outboxtest.Postgres, nil)
	const lease = 500 * time.Millisecond
	// Not listening: the listener would hold a connection of the pool.
	rs := startRuns(t, b, 2, &recorder{}, outbox.WithLease(lease), outbox.WithPublishTimeout(lease/5),
		outbox.WithPollInterval(10*time.Millisecond), outbox.WithListen(false))
	outboxtest.WaitUntil(t, func() bool { return slotsSplit(rs) }, "two dispatchers to split the slots")

	pool, err := rs[0].db.DB()
	mustNil(t, err)
	pool.SetMaxOpenConns(1)
	conn, err := pool.Conn(context.Background())
	mustNil(t, err)
	release := sync.OnceFunc(func() { conn.Close() })
	t.Cleanup(release) // before the Runs stop, should the test fail
	outboxtest.WaitUntil(t, func() bool { return outbox.HeldSlots(rs[0].d) == 0 && slotsSplit(rs[1:]) },
		"the stuck dispatcher to give its slots to the other")
	release()
	outboxtest.WaitUntil(t, func() bool { return slotsSplit(rs) }, "the two dispatchers to split the slots again")
}

// splitRuns starts two Runs that hold slots but, with no wake-up before an
// hour, do not claim: the test claims with DispatchOnce. It returns them
// once they have split the slots, with their recorders.
func splitRuns(t *testing.T, b bundle, batch int) ([]*runner, []*recorder) {
	t.Helper()
	recs := []*recorder{{}, {}}
	var rs []*runner
	for _, rec := range recs {
		rs = append(rs, startRuns(t, b, 1, rec, outbox.WithBatchSize(batch),
			outbox.WithPollInterval(time.Hour), outbox.WithListen(false))...)
	}
	outboxtest.WaitUntil(t, func() bool { return slotsSplit(rs) }, "two dispatchers to split the slots")
	return rs, recs
}

// aggregateNames returns a0 to a(n-1).
func aggregateNames(n int) []string {
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("a%d", i)
	}
	return names
}

// With the slots split, each dispatcher's claim takes the oldest due
// events of the aggregates in its own slots (the slot of an aggregate is
// hashtext(type || ':' || id) & 63), not the oldest of all.
func TestPostgresDispatcherClaimsTheEventsOfItsOwnSlotsFirst(t *testing.T) {
	b := setup(t, outboxtest.Postgres, nil)
	const batch = 20
	rs, recs := splitRuns(t, b, batch)
	publishInterleaved(t, b.db, 4, aggregateNames(40)...)
	for i, r := range rs {
		if n := dispatch(t, r.d); n != batch {
			t.Fatalf("dispatcher %d delivered %d, want a full batch of %d", i, n, batch)
		}
		held := outbox.HeldSlots(r.d)
		for _, m := range recs[i].accepted {
			var slot int
			mustNil(t, b.db.Raw(`SELECT hashtext(? || ':' || ?) & 63`, m.AggregateType, m.AggregateID).Scan(&slot).Error)
			if held&(1<<slot) == 0 {
				t.Errorf("dispatcher %d claimed %s#%d, of slot %d, which it does not hold", i, m.AggregateID, m.Sequence, slot)
			}
		}
	}
}

// A dispatcher whose own slots have nothing due claims from all of them,
// in order: one with nothing to do helps the others.
func TestPostgresDispatcherClaimsFromAllSlotsWhenItsOwnHaveNothingDue(t *testing.T) {
	b := setup(t, outboxtest.Postgres, nil)
	rs, recs := splitRuns(t, b, 1000)
	const aggregates, each = 40, 4
	publishInterleaved(t, b.db, each, aggregateNames(aggregates)...)
	own := dispatch(t, rs[0].d)
	if own == 0 || own == aggregates*each {
		t.Fatalf("first claim delivered %d of %d, want the events of its own slots", own, aggregates*each)
	}
	if n := dispatch(t, rs[0].d); own+n != aggregates*each {
		t.Fatalf("second claim delivered %d, want the other %d", n, aggregates*each-own)
	}
	next := map[string]int64{}
	for _, m := range recs[0].accepted {
		if m.Sequence != next[m.AggregateID]+1 {
			t.Errorf("%s#%d delivered after #%d", m.AggregateID, m.Sequence, next[m.AggregateID])
		}
		next[m.AggregateID] = m.Sequence
	}
}

// A Run holds no slots unless asked to (WithSlots), nor on a *gorm.DB
// opened on a pool of the caller's, which gives it no DSN to open its lock
// connection from; either way it delivers.
func TestPostgresRunHoldsNoSlotsUnlessItCan(t *testing.T) {
	for _, tc := range []struct {
		name  string
		pool  func(b bundle) *gorm.DB
		slots bool
	}{
		{"without WithSlots", func(b bundle) *gorm.DB { return b.db }, false},
		{"on a caller's pool", func(b bundle) *gorm.DB {
			return openPostgres(t, postgres.Config{Conn: openPool(t, b.info.DSN)}, nil)
		}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := setup(t, outboxtest.Postgres, nil)
			publishN(t, b.db, "a", 5)
			rec := &recorder{}
			d := newDispatcher(t, tc.pool(b), rec, outbox.WithSlots(tc.slots), outbox.WithPollInterval(10*time.Millisecond))
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			go func() {
				defer close(done)
				mustNilNow(t, d.Run(ctx))
			}()
			defer func() {
				cancel()
				<-done
			}()
			outboxtest.WaitUntil(t, func() bool { return len(rec.acceptedIDs()) == 5 }, "the five events")
			time.Sleep(300 * time.Millisecond) // more than a look at the slots
			if s := outbox.HeldSlots(d); s != 0 {
				t.Fatalf("the Run holds slots %x, want none", s)
			}
			if n := slotLocks(t, b); n != 0 {
				t.Fatalf("%d slot locks held, want none", n)
			}
		})
	}
}

// A dispatcher looks for the events of its own slots among a bounded run
// of the oldest due events, so that no claim sorts the whole backlog: for
// a batch of up to 1,000 and 32 slots held, the 4,000 oldest. An event of
// its slots behind that run waits, and the claim helps with the oldest of
// all slots instead.
func TestPostgresDispatcherLooksForItsOwnEventsAmongTheOldestOnly(t *testing.T) {
	for _, tc := range []struct {
		name  string
		ahead int // due events of other slots older than the dispatcher's own
		found bool
	}{
		{"within the run", 4000 - 1, true},
		{"behind the run", 4000, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := setup(t, outboxtest.Postgres, nil)
			const batch = 10
			rs, recs := splitRuns(t, b, batch)
			held := outbox.HeldSlots(rs[0].d)
			if n := bits.OnesCount64(held); n != 32 {
				t.Fatalf("the dispatcher holds %d slots, want 32", n)
			}
			var mine string
			var others []string
			for _, name := range aggregateNames(100) {
				var slot int
				mustNil(t, b.db.Raw(`SELECT hashtext('agg:' || ?) & 63`, name).Scan(&slot).Error)
				if held&(1<<slot) != 0 {
					mine = name
				} else {
					others = append(others, name)
				}
			}
			events := make([]outbox.Event, tc.ahead)
			for i := range events {
				events[i] = outbox.Event{Type: "t", AggregateType: "agg", AggregateID: others[i%len(others)]}
			}
			mustNil(t, outbox.Publish(b.db, events...))
			publishN(t, b.db, mine, 1)

			if n := dispatch(t, rs[0].d); n == 0 {
				t.Fatal("the claim delivered nothing")
			}
			found := false
			for _, m := range recs[0].accepted {
				found = found || m.AggregateID == mine
			}
			if found != tc.found {
				t.Fatalf("claimed the event of its own slot behind %d others: %v, want %v", tc.ahead, found, tc.found)
			}
		})
	}
}

// Rows held back behind an aggregate's blocked head are parked by the
// dispatcher that holds the aggregate's slot: one that reads the window of
// all slots because its own have nothing due leaves them to it.
func TestPostgresDispatcherParksOnlyTheRowsOfItsOwnSlots(t *testing.T) {
	b := setup(t, outboxtest.Postgres, nil)
	rs, _ := splitRuns(t, b, 10)
	held := outbox.HeldSlots(rs[1].d)
	var agg string
	for _, name := range aggregateNames(100) {
		var slot int
		mustNil(t, b.db.Raw(`SELECT hashtext('agg:' || ?) & 63`, name).Scan(&slot).Error)
		if held&(1<<slot) != 0 {
			agg = name
			break
		}
	}
	deadLetterFirstOf(t, b, agg, 4)
	parked := func() int64 {
		var n int64
		mustNil(t, b.db.Raw(`SELECT count(*) FROM outbox_records WHERE aggregate_id = ? AND aggregate_sequence > 1
			AND next_attempt_at > now()`, agg).Scan(&n).Error)
		return n
	}

	if n := dispatch(t, rs[0].d); n != 0 {
		t.Fatalf("the other dispatcher delivered %d events behind a dead letter", n)
	}
	if n := parked(); n != 0 {
		t.Fatalf("the other dispatcher parked %d rows of a slot it does not hold", n)
	}
	dispatch(t, rs[1].d)
	if n := parked(); n != 3 {
		t.Fatalf("the holder of the slot parked %d rows behind its dead letter, want 3", n)
	}
}
