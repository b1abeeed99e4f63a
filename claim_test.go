package outbox_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// batchIDs lists each batch the recorder saw as aggregate#sequence.
func (r *recorder) batchIDs() [][]string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out [][]string
	for _, b := range r.batches {
		var ids []string
		for _, m := range b.Messages {
			ids = append(ids, fmt.Sprintf("%s#%d", m.AggregateID, m.Sequence))
		}
		out = append(out, ids)
	}
	return out
}

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

func TestClaimTakesRunsOfTheOldestHeadsFirst(t *testing.T) {
	forEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		publishInterleaved(t, b.db, 3, "a", "b")
		rec := &recorder{}
		d := newDispatcher(t, b.db, rec, outbox.WithBatchSize(4))
		dispatch(t, d)
		dispatch(t, d)
		// A batch lists its messages oldest first.
		if got := fmt.Sprint(rec.batchIDs()); got != "[[a#1 b#1 a#2 a#3] [b#2 b#3]]" {
			t.Fatalf("batches %s, want a's whole run and b's head, then the rest of b's run", got)
		}
	})
}

func TestRunStopsWhereOrderWouldBreak(t *testing.T) {
	for _, tc := range []struct {
		name, change, want string
	}{
		{
			name:   "at the first event not due",
			change: `UPDATE outbox_records SET delivery_state = 'retry', next_attempt_at = ? WHERE aggregate_sequence = 3`,
			want:   "[[a#1 a#2]]", // a#3 waits for its retry, a#4 behind it
		},
		{
			name:   "at a missing sequence",
			change: `UPDATE outbox_records SET delivery_state = 'delivered', delivered_at = ? WHERE aggregate_sequence = 3`,
			want:   "[[a#1 a#2] [a#4]]", // a#3 was accepted out of turn in an earlier partial batch
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			forEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
				b := setup(t, e, nil)
				publishN(t, b.db, "a", 4)
				mustNil(t, b.db.Exec(tc.change, time.Now().Add(time.Hour).UTC()).Error)
				rec := &recorder{}
				d := newDispatcher(t, b.db, rec)
				dispatch(t, d)
				dispatch(t, d)
				if got := fmt.Sprint(rec.batchIDs()); got != tc.want {
					t.Fatalf("batches %s, want %s", got, tc.want)
				}
			})
		})
	}
}

func TestDispatchersSplitABacklogByAggregate(t *testing.T) {
	forEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		publishInterleaved(t, b.db, 3, "a", "b")
		// The first dispatcher claims a's run and holds it in its publisher.
		inFlight, release := make(chan struct{}), make(chan struct{})
		var once sync.Once
		slow := &recorder{next: func(outbox.Batch) error {
			once.Do(func() { close(inFlight) })
			<-release
			return nil
		}}
		first := newDispatcher(t, b.db, slow, outbox.WithBatchSize(3))
		done := make(chan error, 1)
		go func() { _, err := first.DispatchOnce(context.Background()); done <- err }()
		select {
		case <-inFlight:
		case err := <-done:
			t.Fatalf("the first dispatcher published nothing: %v", err)
		}

		// The second takes b's run meanwhile, and nothing of a's.
		rec := &recorder{}
		second := newDispatcher(t, b.db, rec, outbox.WithBatchSize(3))
		dispatch(t, second)
		dispatch(t, second)
		close(release)
		mustNil(t, <-done)
		if got := fmt.Sprint(slow.batchIDs(), rec.batchIDs()); got != "[[a#1 a#2 a#3]] [[b#1 b#2 b#3]]" {
			t.Fatalf("first and second dispatcher published %s; want a's run and b's run", got)
		}
	})
}

func TestEventsBehindADeadLetterAreParkedForALease(t *testing.T) {
	forEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		deadLetterFirstOf(t, b, "poison", 3)
		rec := &recorder{}
		lease := time.Hour
		d := newDispatcher(t, b.db, rec, outbox.WithLease(lease))
		before := time.Now()
		if n := dispatch(t, d); n != 0 || len(rec.batches) != 0 {
			t.Fatalf("published %v behind a dead letter", rec.batchIDs())
		}
		for _, r := range b.records(t)[1:] {
			if r.DeliveryState != "pending" || r.NextAttemptAt.Before(before.Add(lease-time.Minute)) {
				t.Fatalf("poison#%d is %s, next attempt %v; want pending and parked about a lease (%v) from now",
					r.AggregateSequence, r.DeliveryState, r.NextAttemptAt, lease)
			}
		}
	})
}

func TestRetryFailedReleasesTheEventsParkedBehindIt(t *testing.T) {
	forEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		deadLetterFirstOf(t, b, "poison", 3)
		rec := &recorder{}
		d := newDispatcher(t, b.db, rec, outbox.WithLease(time.Hour))
		dispatch(t, d) // parks poison#2 and #3 for the hour-long lease
		if n, err := d.RetryFailed(context.Background()); err != nil || n != 1 {
			t.Fatalf("RetryFailed = %d, %v; want 1", n, err)
		}
		dispatch(t, d)
		if got := fmt.Sprint(rec.batchIDs()); got != "[[poison#1 poison#2 poison#3]]" {
			t.Fatalf("batches %s, want the revived event and the two parked behind it at once", got)
		}
	})
}
