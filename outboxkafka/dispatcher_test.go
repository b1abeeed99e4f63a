package outboxkafka_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

var errRollback = errors.New("rolled back on purpose")

// outboxDB opens a SQLite outbox.
func outboxDB(t *testing.T) *gorm.DB {
	t.Helper()
	db, _ := outboxtest.Open(t, outboxtest.SQLite, nil)
	if err := db.Use(outbox.Plugin()); err != nil {
		t.Fatal(err)
	}
	if err := outbox.AutoMigrate(db); err != nil {
		t.Fatal(err)
	}
	return db
}

// drain dispatches until a round delivers nothing.
func drain(t *testing.T, d *outbox.Dispatcher) {
	t.Helper()
	for range 100 {
		n, err := d.DispatchOnce(context.Background())
		if err != nil {
			t.Fatalf("DispatchOnce: %v", err)
		}
		if n == 0 {
			return
		}
	}
	t.Fatal("the dispatcher was still delivering after 100 rounds")
}

func TestDispatcherDeliversEveryCommittedEventAndNoneRolledBack(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 3)
	topic := uniqueTopic(t)
	db := outboxDB(t)
	committed := map[string]bool{}
	for i := range 30 {
		ev := outbox.Event{
			ID: fmt.Sprintf("tx-%d", i), Type: "order.changed", AggregateType: "order",
			AggregateID: fmt.Sprint(i % 4), Payload: map[string]int{"i": i},
		}
		rollback := i%5 == 0
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
			t.Fatalf("transaction %d: %v", i, err)
		}
		if !rollback {
			committed[ev.ID] = true
		}
	}
	p := newPublisher(t, newClient(t, c.ListenAddrs()), toTopic(topic))
	d, err := outbox.NewDispatcher(db, p, outbox.WithBatchSize(7), outbox.WithPublishTimeout(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	drain(t, d)

	got := map[string]int{}
	last := map[string]int64{}
	for _, rec := range consume(t, c.ListenAddrs(), topic, len(committed), 5*time.Second) {
		e := decode(t, rec)
		got[e.ID()]++
		seq := fmt.Sprint(e.Extensions()["aggregatesequence"])
		var n int64
		fmt.Sscan(seq, &n)
		if key := string(rec.Key); n != last[key]+1 {
			t.Errorf("aggregate %s: sequence %d after %d", key, n, last[key])
		} else {
			last[key] = n
		}
	}
	for id := range committed {
		if got[id] != 1 {
			t.Errorf("committed event %s consumed %d times, want once", id, got[id])
		}
	}
	for id := range got {
		if !committed[id] {
			t.Errorf("consumed %s, which is not a committed event", id)
		}
	}
	var undelivered int64
	if err := db.Raw(`SELECT count(*) FROM outbox_records WHERE delivery_state <> 'delivered'`).Scan(&undelivered).Error; err != nil {
		t.Fatal(err)
	}
	if undelivered != 0 {
		t.Errorf("%d rows not delivered", undelivered)
	}
}

func TestDispatcherDeadLettersAnOversizedEventAndHoldsBackItsAggregate(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 1)
	db := outboxDB(t)
	events := []outbox.Event{
		{ID: "big", Type: "t", AggregateType: "order", AggregateID: "1", Payload: strings.Repeat("x", 1<<20)},
		{ID: "after-big", Type: "t", AggregateType: "order", AggregateID: "1", Payload: 1},
		{ID: "other", Type: "t", AggregateType: "order", AggregateID: "2", Payload: 2},
	}
	if err := outbox.Publish(db, events...); err != nil {
		t.Fatal(err)
	}
	p := newPublisher(t, newClient(t, c.ListenAddrs()), toTopic(uniqueTopic(t)))
	d, err := outbox.NewDispatcher(db, p)
	if err != nil {
		t.Fatal(err)
	}
	drain(t, d)
	states := map[string]string{}
	rows, err := db.Raw(`SELECT event_id, delivery_state FROM outbox_records`).Rows()
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var id, state string
		if err := rows.Scan(&id, &state); err != nil {
			t.Fatal(err)
		}
		states[id] = state
	}
	want := map[string]string{"big": "failed", "after-big": "pending", "other": "delivered"}
	if fmt.Sprint(states) != fmt.Sprint(want) {
		t.Errorf("states = %v, want %v", states, want)
	}
}
