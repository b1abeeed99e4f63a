package outbox_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// publishInterleaved publishes n events to each aggregate, taking turns:
// a#1 b#1 a#2 b#2 ...
func publishInterleaved(t *testing.T, db *gorm.DB, n int, aggregates ...string) {
	t.Helper()
	for range n {
		for _, a := range aggregates {
			publishN(t, db, a, 1)
		}
	}
}

// deadLetterFirstOf publishes n events to aggregate and dead-letters the
// first.
func deadLetterFirstOf(t *testing.T, b bundle, aggregate string, n int) {
	t.Helper()
	publishN(t, b.db, aggregate, n)
	mustNil(t, b.db.Exec(`UPDATE outbox_records SET delivery_state = 'failed' WHERE aggregate_id = ? AND aggregate_sequence = 1`, aggregate).Error)
}

// holdFirstBatch starts a dispatcher of the given batch size whose
// publisher holds the first batch it gets until release is called, and
// returns once that batch is in flight. release waits for the dispatch to
// end.
func holdFirstBatch(t *testing.T, db *gorm.DB, batch int) (held *recorder, release func()) {
	t.Helper()
	inFlight, let := make(chan struct{}), make(chan struct{})
	var once sync.Once
	held = &recorder{Next: func(outbox.Batch) error {
		once.Do(func() { close(inFlight) })
		<-let
		return nil
	}}
	d := newDispatcher(t, db, held, outbox.WithBatchSize(batch))
	done := make(chan error, 1)
	go func() { _, err := d.DispatchOnce(context.Background()); done <- err }()
	select {
	case <-inFlight:
	case err := <-done:
		t.Fatalf("the holding dispatcher published nothing: %v", err)
	}
	return held, func() {
		close(let)
		mustNil(t, <-done)
	}
}

// twoClaims dispatches twice with a new dispatcher, and returns the
// batches it published as event ids.
func twoClaims(t *testing.T, db *gorm.DB, opts ...outbox.DispatcherOption) string {
	t.Helper()
	rec := &recorder{}
	d := newDispatcher(t, db, rec, opts...)
	dispatch(t, d)
	dispatch(t, d)
	return fmt.Sprint(rec.BatchIDs())
}

func TestClaimTakesTheOldestEventsFirst(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		publishInterleaved(t, b.db, 3, "a", "b")
		// The four oldest events, then the rest; a batch lists its
		// messages oldest first.
		if got, want := twoClaims(t, b.db, outbox.WithBatchSize(4)), "[[a#1 b#1 a#2 b#2] [a#3 b#3]]"; got != want {
			t.Fatalf("batches %s, want %s", got, want)
		}
	})
}

func TestClaimStopsOnlyWhereOrderWouldBreak(t *testing.T) {
	for _, tc := range []struct {
		name, change, want string
	}{
		{
			name:   "at the first event not due",
			change: `UPDATE outbox_records SET delivery_state = 'retry', next_attempt_at = ? WHERE aggregate_sequence = 3`,
			want:   "[[a#1 a#2]]", // a#3 waits for its retry, a#4 behind it
		},
		{
			name:   "at an event in flight",
			change: `UPDATE outbox_records SET delivery_state = 'delivering', next_attempt_at = ? WHERE aggregate_sequence = 3`,
			want:   "[[a#1 a#2]]", // a#4 waits for a#3 to be accepted
		},
		{
			// a#3 was accepted, and marked delivered by a settle that came
			// after its lease had passed, while a#1 and a#2, claimed again
			// meanwhile, went back. a#4 may go: the event before it was
			// accepted, after a#1 and a#2 were first accepted. It goes in
			// the next claim: in the first one, a#1 and a#2 come first.
			name:   "not behind an event accepted before the events before it came back",
			change: `UPDATE outbox_records SET delivery_state = 'delivered', delivered_at = ? WHERE aggregate_sequence = 3`,
			want:   "[[a#1 a#2] [a#4]]",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
				b := setup(t, e, nil)
				publishN(t, b.db, "a", 4)
				mustNil(t, b.db.Exec(tc.change, time.Now().Add(time.Hour).UTC()).Error)
				if got := twoClaims(t, b.db); got != tc.want {
					t.Fatalf("batches %s, want %s", got, tc.want)
				}
			})
		})
	}
}

func TestClaimPassesByTheAggregatesAnotherDispatcherHolds(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		if e == outboxtest.SQLite {
			t.Skip("SQLite's claims read no shards: a second dispatcher's claim waits for the batch that holds its window back")
		}
		b := setup(t, e, nil)
		publishN(t, b.db, "a", 4)
		others := []string{"b0", "b1", "b2", "b3", "b4", "b5", "b6", "b7"}
		for _, o := range others {
			publishN(t, b.db, o, 1)
		}
		held, release := holdFirstBatch(t, b.db, 2) // a#1 a#2

		// The oldest due events, a#3 and a#4, must wait for a#2. Held
		// back, the second dispatcher claims by shard, and reaches the
		// events of the other aggregates in other shards than a's (a
		// shard's window starts with a#3 and a#4 too, where a is). A
		// shard held back sends it to a random one: 400 claims miss
		// every other shard with a chance below 1e-11.
		rec := &recorder{}
		second := newDispatcher(t, b.db, rec, outbox.WithBatchSize(2))
		for i := 0; i < 400 && len(rec.AcceptedIDs()) == 0; i++ {
			dispatch(t, second)
		}
		release()
		if got := fmt.Sprint(held.BatchIDs()); got != "[[a#1 a#2]]" {
			t.Fatalf("the first dispatcher published %s, want a#1 a#2", got)
		}
		accepted := rec.AcceptedIDs()
		if len(accepted) == 0 {
			t.Fatal("the second dispatcher published nothing while a's batch was in flight")
		}
		for _, id := range accepted {
			if strings.HasPrefix(id, "agg/a#") {
				t.Fatalf("the second dispatcher published %s while a#2 was in flight", id)
			}
		}
	})
}

func TestClaimLooksUpTheEventsBeforeThoseOfManyAggregates(t *testing.T) {
	const aggregates = 1200
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		mustNil(t, b.db.Transaction(func(tx *gorm.DB) error {
			for seq := range 2 {
				for a := range aggregates {
					if err := outbox.Publish(tx, outbox.Event{Type: "t", AggregateType: "agg", AggregateID: fmt.Sprint("a", a), Payload: seq}); err != nil {
						return err
					}
				}
			}
			return nil
		}))
		// The first events were delivered by some other dispatcher, but for
		// every hundredth aggregate's, which was dead-lettered.
		mustNil(t, b.db.Exec(`UPDATE outbox_records SET delivery_state = 'delivered', delivered_at = ? WHERE aggregate_sequence = 1`, time.Now().UTC()).Error)
		var held []string
		for a := 0; a < aggregates; a += 100 {
			held = append(held, fmt.Sprint("a", a))
		}
		mustNil(t, b.db.Exec(`UPDATE outbox_records SET delivery_state = 'failed', delivered_at = NULL WHERE aggregate_sequence = 1 AND aggregate_id IN ?`, held).Error)

		rec := &recorder{}
		d := newDispatcher(t, b.db, rec, outbox.WithBatchSize(2*aggregates))
		if n := dispatch(t, d); n != aggregates-len(held) {
			t.Fatalf("delivered %d events, want the %d whose event before was delivered", n, aggregates-len(held))
		}
		for _, batch := range rec.BatchIDs() {
			for _, id := range batch {
				for _, h := range held {
					if id == h+"#2" {
						t.Errorf("%s was published behind a dead letter", id)
					}
				}
			}
		}
	})
}
