package brokertest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// OpenOutbox returns a fresh SQLite database with the outbox plugin and
// its migrated tables, removed when t ends, and the info a dispatcher
// process opens it again with.
func OpenOutbox(t testing.TB) (*gorm.DB, outboxtest.DB) {
	t.Helper()
	db, info := outboxtest.Open(t, outboxtest.SQLite, nil)
	if err := db.Use(outbox.Plugin()); err != nil {
		t.Fatal(err)
	}
	if err := outbox.AutoMigrate(db); err != nil {
		t.Fatal(err)
	}
	return db, info
}

// Written is what WriteEvents wrote: the ids of the events it committed
// and of those whose transaction rolled back.
type Written struct {
	Committed, RolledBack map[string]bool
}

// Add adds the events of more to w.
func (w Written) Add(more Written) {
	for id := range more.Committed {
		w.Committed[id] = true
	}
	for id := range more.RolledBack {
		w.RolledBack[id] = true
	}
}

var eventSeq atomic.Int64

var errRollback = errors.New("brokertest: rolled back on purpose")

// WriteEvents commits n events to db's outbox, one transaction each,
// spread over the aggregates order/0 to order/<aggregates-1>; after every
// fifth, a transaction records one more event of the same aggregate and
// rolls back, so that a sequence the rollback took must not show as a gap.
// It checks that the table then holds every committed event and none
// rolled back, and returns their ids, which no other call in the process
// uses.
func WriteEvents(t testing.TB, db *gorm.DB, n, aggregates int) Written {
	t.Helper()
	w := Written{Committed: map[string]bool{}, RolledBack: map[string]bool{}}
	write := func(i int, rollback bool) {
		ev := outbox.Event{
			ID: fmt.Sprintf("evt-%d", eventSeq.Add(1)), Type: "order.changed", AggregateType: "order",
			AggregateID: fmt.Sprint(i % aggregates), Payload: map[string]int{"i": i},
		}
		err := db.Transaction(func(tx *gorm.DB) error {
			if err := outbox.Publish(tx, ev); err != nil {
				return err
			}
			if rollback {
				return errRollback
			}
			return nil
		})
		if rollback != errors.Is(err, errRollback) {
			t.Fatalf("transaction %d (rollback %v): %v", i, rollback, err)
		}
		if rollback {
			w.RolledBack[ev.ID] = true
		} else {
			w.Committed[ev.ID] = true
		}
	}
	for i := range n {
		write(i, false)
		if i%5 == 4 {
			write(i, true)
		}
	}
	var ids []string
	if err := db.Table(outbox.DefaultTable).Pluck("event_id", &ids).Error; err != nil {
		t.Fatal(err)
	}
	inTable := map[string]bool{}
	for _, id := range ids {
		inTable[id] = true
		if w.RolledBack[id] {
			t.Fatalf("event %s of a rolled-back transaction is in the table", id)
		}
	}
	for id := range w.Committed {
		if !inTable[id] {
			t.Fatalf("committed event %s is not in the table", id)
		}
	}
	return w
}

// Drain runs d's DispatchOnce until a round finds nothing due, failing t
// when a round fails or after 1,000 rounds.
func Drain(t testing.TB, d *outbox.Dispatcher) {
	t.Helper()
	for range 1000 {
		n, err := d.DispatchOnce(context.Background())
		if err != nil {
			t.Fatalf("DispatchOnce: %v", err)
		}
		if n == 0 {
			return
		}
	}
	t.Fatal("the dispatcher was still delivering after 1,000 rounds")
}

// Undelivered returns how many rows of db's outbox are not delivered.
func Undelivered(t testing.TB, db *gorm.DB) int64 {
	t.Helper()
	var n int64
	if err := db.Table(outbox.DefaultTable).Where("delivery_state <> ?", outbox.StateDelivered).Count(&n).Error; err != nil {
		t.Fatal(err)
	}
	return n
}

// WaitDelivered waits until every row of db's outbox is delivered, as
// dispatcher processes deliver it, failing t when some are not within
// timeout.
func WaitDelivered(t testing.TB, db *gorm.DB, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		n := Undelivered(t, db)
		if n == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d events still undelivered after %v", n, timeout)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// States returns the delivery state and attempts, "state/attempts", of
// every row of db's outbox by event id.
func States(t testing.TB, db *gorm.DB) map[string]string {
	t.Helper()
	var rows []struct {
		EventID          string
		DeliveryState    string
		DeliveryAttempts int
	}
	if err := db.Table(outbox.DefaultTable).Select("event_id, delivery_state, delivery_attempts").Scan(&rows).Error; err != nil {
		t.Fatal(err)
	}
	got := make(map[string]string, len(rows))
	for _, r := range rows {
		got[r.EventID] = fmt.Sprintf("%s/%d", r.DeliveryState, r.DeliveryAttempts)
	}
	return got
}

// DeliverAll dispatches db's outbox through p, with a dispatcher made with
// opts and a logger writing to t's log, until a round finds nothing due,
// and checks that every row was then delivered.
func DeliverAll(t testing.TB, db *gorm.DB, p outbox.Publisher, opts ...outbox.DispatcherOption) {
	t.Helper()
	drainThrough(t, db, p, opts)
	if n := Undelivered(t, db); n != 0 {
		t.Errorf("%d events not settled as delivered", n)
	}
}

// Dispatch commits events to a fresh outbox, dispatches them through p,
// with a dispatcher made with opts and a logger writing to t's log, until
// a round finds nothing due, and returns each row's "state/attempts" by
// event id.
func Dispatch(t testing.TB, p outbox.Publisher, events []outbox.Event, opts ...outbox.DispatcherOption) map[string]string {
	t.Helper()
	db, _ := OpenOutbox(t)
	if err := outbox.Publish(db, events...); err != nil {
		t.Fatal(err)
	}
	drainThrough(t, db, p, opts)
	return States(t, db)
}

func drainThrough(t testing.TB, db *gorm.DB, p outbox.Publisher, opts []outbox.DispatcherOption) {
	t.Helper()
	d, err := outbox.NewDispatcher(db, p, append([]outbox.DispatcherOption{outbox.WithLogger(outboxtest.Logger(t))}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	Drain(t, d)
}

// CheckStates checks that got, as States returns it, is want.
func CheckStates(t testing.TB, got, want map[string]string) {
	t.Helper()
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("rows (state/attempts) = %v, want %v", got, want)
	}
}

// OversizedEvents returns three events for a publisher that refuses a
// payload of size bytes as too large for its broker: "big", of aggregate
// order/1, with such a payload; "after-big", the next event of order/1;
// and "other", of order/2.
func OversizedEvents(size int) []outbox.Event {
	return []outbox.Event{
		{ID: "big", Type: "order.changed", AggregateType: "order", AggregateID: "1", Payload: strings.Repeat("x", size)},
		{ID: "after-big", Type: "order.changed", AggregateType: "order", AggregateID: "1", Payload: 1},
		{ID: "other", Type: "order.changed", AggregateType: "order", AggregateID: "2", Payload: 2},
	}
}

// CheckOversizedEventIsDeadLettered dispatches OversizedEvents(size)
// through p, with a dispatcher made with opts, and checks that big failed
// at its first attempt, that after-big waits behind it, never tried, and
// that other was delivered.
func CheckOversizedEventIsDeadLettered(t testing.TB, p outbox.Publisher, size int, opts ...outbox.DispatcherOption) {
	t.Helper()
	CheckStates(t, Dispatch(t, p, OversizedEvents(size), opts...),
		map[string]string{"big": "failed/1", "after-big": "pending/0", "other": "delivered/1"})
}
