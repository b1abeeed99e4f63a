package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
	"github.com/gorm-outbox/outbox/internal/outboxtest/deliveries"
)

// recorder is the suite's recording publisher.
type recorder = deliveries.Recorder

func newDispatcher(t *testing.T, db *gorm.DB, p outbox.Publisher, opts ...outbox.DispatcherOption) *outbox.Dispatcher {
	t.Helper()
	opts = append([]outbox.DispatcherOption{outbox.WithLogger(outboxtest.Logger(t))}, opts...)
	d, err := outbox.NewDispatcher(db, p, opts...)
	if err != nil {
		t.Fatalf("NewDispatcher: %v", err)
	}
	return d
}

func publishN(t *testing.T, db *gorm.DB, aggregate string, n int) {
	t.Helper()
	for range n {
		mustNil(t, outbox.Publish(db, outbox.Event{Type: "t", AggregateType: "agg", AggregateID: aggregate, Payload: map[string]string{"a": aggregate}}))
	}
}

func dispatch(t *testing.T, d *outbox.Dispatcher) int {
	t.Helper()
	n, err := d.DispatchOnce(context.Background())
	mustNil(t, err)
	return n
}

func states(t *testing.T, b bundle) []string {
	t.Helper()
	var s []string
	for _, r := range b.records(t) {
		s = append(s, r.DeliveryState)
	}
	return s
}

func TestDispatchDeliversAndSettles(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		o := Order{Status: "new", Total: 3}
		mustNil(t, b.db.Create(&o).Error)
		mustNil(t, outbox.Publish(b.db, outbox.Event{Type: "order.noted", AggregateType: "order", AggregateID: fmt.Sprint(o.ID), Headers: map[string]string{"h": "v"}}))
		rec := &recorder{}
		d := newDispatcher(t, b.db, rec)
		if n := dispatch(t, d); n != 2 {
			t.Fatalf("delivered %d, want 2", n)
		}
		if len(rec.Batches()) != 1 || len(rec.Batches()[0].Messages) != 2 || rec.Batches()[0].ID == "" {
			t.Fatalf("batches %+v, want one batch of 2 with an id", rec.Batches())
		}
		m := rec.Batches()[0].Messages
		if m[0].EventType != "order.create" || m[0].Sequence != 1 || m[1].Sequence != 2 || m[0].Attempt != 1 || m[1].Headers["h"] != "v" {
			t.Fatalf("messages %+v", m)
		}
		assertJSON(t, string(m[0].Payload), `{"ID":1,"Status":"new","Total":3}`)
		for _, r := range b.records(t) {
			if r.DeliveryState != "delivered" || !r.DeliveredAt.Valid || r.BatchID.String != rec.Batches()[0].ID || r.DeliveryAttempts != 1 || r.LockedUntil.Valid {
				t.Fatalf("row after delivery: %+v", r)
			}
		}
		if n := dispatch(t, d); n != 0 || len(rec.Batches()) != 1 {
			t.Fatalf("a delivered row was dispatched again")
		}
	})
}

func TestFailedPublishSchedulesRetryWithBackoff(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		publishN(t, b.db, "a", 1)
		rec := &recorder{Next: func(outbox.Batch) error { return errors.New("broker down") }}
		d := newDispatcher(t, b.db, rec)
		before := time.Now()
		if n := dispatch(t, d); n != 0 {
			t.Fatalf("delivered %d, want 0", n)
		}
		r := b.records(t)[0]
		if r.DeliveryState != "retry" || r.DeliveryAttempts != 1 || r.LastError.String != "broker down" {
			t.Fatalf("row %+v, want retry after 1 attempt with the error", r)
		}
		wait := r.NextAttemptAt.Sub(before)
		if wait < 47*time.Second || wait > 73*time.Second {
			t.Fatalf("next attempt in %v, want one minute ±20%%", wait)
		}
		if n := dispatch(t, d); n != 0 || len(rec.Batches()) != 1 {
			t.Fatalf("a row was retried before its time")
		}
	})
}

func TestPermanentErrorDeadLetters(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		publishN(t, b.db, "a", 2)
		d := newDispatcher(t, b.db, &recorder{Next: func(outbox.Batch) error { return outbox.Permanent(errors.New("schema rejected")) }})
		dispatch(t, d)
		if s := fmt.Sprint(states(t, b)); s != "[failed failed]" {
			t.Fatalf("states %s, want both failed", s)
		}
	})
}

func TestMaxAttemptsDeadLetters(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		publishN(t, b.db, "a", 1)
		now := outbox.RetryPolicyFunc(func(int, error) time.Duration { return 0 })
		rec := &recorder{Next: func(outbox.Batch) error { return errors.New("nope") }}
		d := newDispatcher(t, b.db, rec, outbox.WithMaxAttempts(3), outbox.WithRetryPolicy(now))
		for range 5 {
			dispatch(t, d)
		}
		r := b.records(t)[0]
		if len(rec.Batches()) != 3 || r.DeliveryState != "failed" || r.DeliveryAttempts != 3 {
			t.Fatalf("%d attempts, row %s after %d; want 3 attempts then failed", len(rec.Batches()), r.DeliveryState, r.DeliveryAttempts)
		}
		if got := []int{rec.Batches()[0].Messages[0].Attempt, rec.Batches()[2].Messages[0].Attempt}; got[0] != 1 || got[1] != 3 {
			t.Fatalf("Attempt numbers %v, want 1 then 3", got)
		}
	})
}

func TestPartialBatchSettlesEachMessage(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		publishN(t, b.db, "a", 1)
		publishN(t, b.db, "b", 1)
		publishN(t, b.db, "c", 2)
		rec := &recorder{Next: func(b outbox.Batch) error {
			return &outbox.PartialError{Failed: map[string]error{
				b.Messages[1].EventID: errors.New("b failed"),
				b.Messages[2].EventID: outbox.Permanent(errors.New("c poison")),
				b.Messages[3].EventID: outbox.ErrNotAttempted,
			}}
		}}
		d := newDispatcher(t, b.db, rec)
		if n := dispatch(t, d); n != 1 {
			t.Fatalf("delivered %d, want 1", n)
		}
		rs := b.records(t)
		got := fmt.Sprintf("%s/%d %s/%d %s/%d %s/%d", rs[0].DeliveryState, rs[0].DeliveryAttempts, rs[1].DeliveryState, rs[1].DeliveryAttempts,
			rs[2].DeliveryState, rs[2].DeliveryAttempts, rs[3].DeliveryState, rs[3].DeliveryAttempts)
		if want := "delivered/1 retry/1 failed/1 pending/0"; got != want {
			t.Fatalf("states/attempts %s, want %s", got, want)
		}
	})
}

func TestExpiredLeaseIsReclaimed(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		publishN(t, b.db, "a", 1)
		publishN(t, b.db, "b", 1)
		// A dispatcher died holding both rows: one lease has passed, one lives.
		past, future := time.Now().Add(-time.Second).UTC(), time.Now().Add(time.Hour).UTC()
		mustNil(t, b.db.Exec(`UPDATE outbox_records SET delivery_state = 'delivering', batch_id = 'dead', locked_until = ?, next_attempt_at = ? WHERE aggregate_id = 'a'`, past, past).Error)
		mustNil(t, b.db.Exec(`UPDATE outbox_records SET delivery_state = 'delivering', batch_id = 'alive', locked_until = ?, next_attempt_at = ? WHERE aggregate_id = 'b'`, future, future).Error)
		rec := &recorder{}
		if n := dispatch(t, newDispatcher(t, b.db, rec)); n != 1 {
			t.Fatalf("delivered %d, want 1", n)
		}
		if got := fmt.Sprint(rec.AcceptedIDs()); got != "[agg/a#1]" {
			t.Fatalf("accepted %s, want only the expired lease's row", got)
		}
	})
}

// delayError asks for a retry delay, like an HTTP 429 with Retry-After.
type delayError struct{ d time.Duration }

func (e delayError) Error() string             { return "slow down" }
func (e delayError) RetryDelay() time.Duration { return e.d }

func TestRetryWaitsAtLeastWhatThePublisherAsks(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		publishN(t, b.db, "a", 1)
		publishN(t, b.db, "b", 1)
		publishN(t, b.db, "c", 1)
		d := newDispatcher(t, b.db, &recorder{Next: func(outbox.Batch) error {
			return fmt.Errorf("gateway: %w", delayError{time.Hour})
		}})
		before := time.Now()
		dispatch(t, d)
		rs := b.records(t)
		if wait := rs[0].NextAttemptAt.Sub(before); wait < time.Hour-time.Second {
			t.Fatalf("next attempt in %v, want at least the hour the publisher asked for", wait)
		}
		for _, r := range rs[1:] {
			if !r.NextAttemptAt.Equal(rs[0].NextAttemptAt) {
				t.Fatalf("rows of one failed batch got different retry times %v and %v: they would come back split", rs[0].NextAttemptAt, r.NextAttemptAt)
			}
		}
	})
}

func TestStatsCountsRowsByState(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		publishN(t, b.db, "a", 1)
		publishN(t, b.db, "b", 2)
		d := newDispatcher(t, b.db, &recorder{Next: func(batch outbox.Batch) error {
			return &outbox.PartialError{Failed: map[string]error{
				batch.Messages[1].EventID: outbox.Permanent(errors.New("poison b")),
				batch.Messages[2].EventID: outbox.ErrNotAttempted,
			}}
		}})
		dispatch(t, d)
		publishN(t, b.db, "c", 1)
		s, err := d.Stats(context.Background())
		mustNil(t, err)
		got := fmt.Sprintf("pending %d delivering %d delivered %d retry %d failed %d undelivered %d last %q",
			s.Pending, s.Delivering, s.Delivered, s.Retry, s.Failed, s.Undelivered(), s.LastFailure)
		if want := `pending 2 delivering 0 delivered 1 retry 0 failed 1 undelivered 3 last "permanent: poison b"`; got != want {
			t.Fatalf("stats %s, want %s", got, want)
		}
		if s.OldestDue.IsZero() || time.Since(s.OldestDue) > time.Minute {
			t.Fatalf("OldestDue = %v, want the time the pending rows became due", s.OldestDue)
		}
	})
}
