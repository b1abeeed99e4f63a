package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
	"github.com/gorm-outbox/outbox/internal/outboxtest/deliveries"
)

func TestFailedPredecessorHoldsBackItsAggregateOnly(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		publishN(t, b.db, "a", 3)
		publishN(t, b.db, "b", 2)
		failA1 := true
		rec := &recorder{Next: func(batch outbox.Batch) error {
			failed := map[string]error{}
			for _, m := range batch.Messages {
				switch {
				case m.AggregateID != "a" || !failA1:
				case len(failed) == 0:
					failed[m.EventID] = errors.New("a#1 down")
				default:
					failed[m.EventID] = outbox.ErrNotAttempted
				}
			}
			if len(failed) == 0 {
				return nil
			}
			return &outbox.PartialError{Failed: failed}
		}}
		zero := outbox.RetryPolicyFunc(func(int, error) time.Duration { return 0 })
		d := newDispatcher(t, b.db, rec, outbox.WithRetryPolicy(zero), outbox.WithPollInterval(time.Millisecond))
		dispatch(t, d)
		if got := fmt.Sprint(rec.AcceptedIDs()); got != "[agg/b#1 agg/b#2]" {
			t.Fatalf("accepted %s, want b's events only", got)
		}
		// a#1 is due again at once (zero backoff); a#2 and a#3 were not
		// attempted, are due after the poll interval, and still come only
		// after a#1.
		failA1 = false
		for range 3 {
			time.Sleep(5 * time.Millisecond)
			dispatch(t, d)
		}
		if got := fmt.Sprint(rec.AcceptedIDs()); got != "[agg/b#1 agg/b#2 agg/a#1 agg/a#2 agg/a#3]" {
			t.Fatalf("accepted %s, want a's events in order after b's", got)
		}
		r := b.records(t)[1]
		if r.DeliveryAttempts != 1 {
			t.Fatalf("a#2 counted %d attempts; messages not attempted must not count", r.DeliveryAttempts)
		}
	})
}

func TestMessageAcceptedAfterAFailedOneIsDeliveredAgainAfterIt(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		publishN(t, b.db, "a", 3)
		first := true
		// Against the Publisher contract, the first batch accepts a#2 after
		// a#1 failed.
		rec := &recorder{Next: func(batch outbox.Batch) error {
			if !first {
				return nil
			}
			first = false
			return &outbox.PartialError{Failed: map[string]error{
				batch.Messages[0].EventID: errors.New("a#1 down"),
				batch.Messages[2].EventID: outbox.ErrNotAttempted,
			}}
		}}
		zero := outbox.RetryPolicyFunc(func(int, error) time.Duration { return 0 })
		d := newDispatcher(t, b.db, rec, outbox.WithRetryPolicy(zero), outbox.WithPollInterval(time.Millisecond))
		if n := dispatch(t, d); n != 0 {
			t.Fatalf("delivered %d, want 0: a#2 came after a failed a#1", n)
		}
		if s := fmt.Sprint(states(t, b)); s != "[retry pending pending]" {
			t.Fatalf("states %s, want [retry pending pending]: a#2 must not be marked delivered ahead of a#1", s)
		}
		for range 3 {
			time.Sleep(5 * time.Millisecond)
			dispatch(t, d)
		}
		if got := fmt.Sprint(rec.AcceptedIDs()); got != "[agg/a#2 agg/a#1 agg/a#2 agg/a#3]" {
			t.Fatalf("accepted %s, want a#2 again after a#1, then a#3", got)
		}
		if s := fmt.Sprint(states(t, b)); s != "[delivered delivered delivered]" {
			t.Fatalf("states %s, want all delivered", s)
		}
	})
}

func TestRetryingPredecessorHoldsBackDueSuccessor(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		publishN(t, b.db, "a", 2)
		// a#1 waits for a retry in an hour; a#2 is due now.
		later := time.Now().Add(time.Hour).UTC()
		mustNil(t, b.db.Exec(`UPDATE outbox_records SET delivery_state = 'retry', delivery_attempts = 1, next_attempt_at = ? WHERE aggregate_sequence = 1`, later).Error)
		rec := &recorder{}
		d := newDispatcher(t, b.db, rec)
		if n := dispatch(t, d); n != 0 || len(rec.Batches()) != 0 {
			t.Fatalf("a#2 was published while a#1 waits for its retry")
		}
		r := b.records(t)[1]
		if r.DeliveryState != "pending" || r.NextAttemptAt.Before(later.Add(-time.Second)) {
			t.Fatalf("a#2 is %s, next attempt %v; want pending and pushed back to a#1's retry at %v", r.DeliveryState, r.NextAttemptAt, later)
		}
	})
}

func TestRowsBehindAWaitingHeadAreParkedUntilItCanMove(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		for _, agg := range []string{"retry", "dead", "flight"} {
			publishN(t, b.db, agg, 3)
		}
		publishN(t, b.db, "free", 1)
		retryAt := time.Now().Add(time.Hour).UTC().Truncate(time.Millisecond)
		mustNil(t, b.db.Exec(`UPDATE outbox_records SET delivery_state = 'retry', delivery_attempts = 1, next_attempt_at = ? WHERE aggregate_id = 'retry' AND aggregate_sequence = 1`, retryAt).Error)
		mustNil(t, b.db.Exec(`UPDATE outbox_records SET delivery_state = 'failed', delivery_attempts = 1 WHERE aggregate_id = 'dead' AND aggregate_sequence = 1`).Error)
		mustNil(t, b.db.Exec(`UPDATE outbox_records SET delivery_state = 'delivering', next_attempt_at = ?, locked_until = ? WHERE aggregate_id = 'flight' AND aggregate_sequence = 1`, retryAt, retryAt).Error)

		const lease = 2 * time.Hour
		before := time.Now()
		rec := &recorder{}
		d := newDispatcher(t, b.db, rec, outbox.WithLease(lease))
		dispatch(t, d) // takes free#1 only: a batch that is not full parks
		if got := fmt.Sprint(rec.AcceptedIDs()); got != "[agg/free#1]" {
			t.Fatalf("accepted %s, want the free aggregate only", got)
		}

		for _, r := range b.records(t) {
			if r.AggregateSequence == 1 {
				continue
			}
			at := r.NextAttemptAt
			var ok bool
			var want string
			switch r.AggregateID {
			case "retry":
				ok, want = at.Equal(retryAt), fmt.Sprintf("its head's retry at %v", retryAt)
			case "dead":
				ok, want = !at.Before(before.Add(lease)) && !at.After(time.Now().Add(lease)), "one lease from now"
			case "flight":
				ok, want = !at.After(before), "left due: its head settles within the publish timeout"
			}
			if !ok {
				t.Errorf("%s#%d: next attempt %v, want %s", r.AggregateID, r.AggregateSequence, at, want)
			}
			if r.DeliveryState != "pending" {
				t.Errorf("%s#%d: state %s, want pending", r.AggregateID, r.AggregateSequence, r.DeliveryState)
			}
		}
	})
}

func TestDeadLetterHoldsBackItsAggregateUntilRetried(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		publishN(t, b.db, "poison", 1)
		publishN(t, b.db, "poison", 1)
		publishN(t, b.db, "ok", 1)
		poisoned := true
		rec := &recorder{Next: func(batch outbox.Batch) error {
			failed := map[string]error{}
			for _, m := range batch.Messages {
				switch {
				case m.AggregateID == "poison" && m.Sequence == 1 && poisoned:
					failed[m.EventID] = outbox.Permanent(errors.New("poison"))
				case m.AggregateID == "poison" && poisoned:
					failed[m.EventID] = outbox.ErrNotAttempted
				}
			}
			if len(failed) == 0 {
				return nil
			}
			return &outbox.PartialError{Failed: failed}
		}}
		d := newDispatcher(t, b.db, rec, outbox.WithLease(time.Hour))
		dispatch(t, d)
		dispatch(t, d)
		if got := fmt.Sprint(rec.AcceptedIDs()); got != "[agg/ok#1]" {
			t.Fatalf("accepted %s, want the other aggregate only", got)
		}
		if s := fmt.Sprint(states(t, b)); s != "[failed pending delivered]" {
			t.Fatalf("states %s, want [failed pending delivered]", s)
		}
		// An operator fixes the consumer and sweeps.
		poisoned = false
		if n, err := d.RetryFailed(context.Background()); err != nil || n != 0 {
			t.Fatalf("RetryFailed = %d, %v; want 0: a permanent failure stays dead", n, err)
		}
		n, err := d.Requeue(context.Background(), outbox.RequeueFilter{})
		if err != nil || n != 1 {
			t.Fatalf("Requeue = %d, %v; want 1", n, err)
		}
		mustNil(t, b.db.Exec(`UPDATE outbox_records SET next_attempt_at = ? WHERE aggregate_id = 'poison'`, time.Now().Add(-time.Second).UTC()).Error)
		dispatch(t, d)
		if got := fmt.Sprint(rec.AcceptedIDs()); got != "[agg/ok#1 agg/poison#1 agg/poison#2]" {
			t.Fatalf("accepted %s, want the poison aggregate in order after the requeue", got)
		}
	})
}

func TestRequeueFiltersAndBounds(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		for i, typ := range []string{"x", "x", "y", "x"} {
			mustNil(t, outbox.Publish(b.db, outbox.Event{Type: typ, AggregateType: "agg", AggregateID: fmt.Sprint(i)}))
		}
		mustNil(t, b.db.Exec(`UPDATE outbox_records SET delivery_state = 'failed', delivery_attempts = 10`).Error)
		d := newDispatcher(t, b.db, &recorder{})
		ctx := context.Background()
		if n, err := d.Requeue(ctx, outbox.RequeueFilter{EventTypes: []string{"y"}}); n != 1 || err != nil {
			t.Fatalf("by type: %d, %v; want 1", n, err)
		}
		if n, err := d.Requeue(ctx, outbox.RequeueFilter{FailedBefore: time.Now().Add(-time.Hour)}); n != 0 || err != nil {
			t.Fatalf("by age: %d, %v; want 0 (all failed just now)", n, err)
		}
		if n, err := d.Requeue(ctx, outbox.RequeueFilter{Limit: 2}); n != 2 || err != nil {
			t.Fatalf("bounded: %d, %v; want 2", n, err)
		}
		var last string
		mustNil(t, b.db.Raw(`SELECT event_id FROM outbox_records WHERE delivery_state = 'failed'`).Scan(&last).Error)
		if n, err := d.Requeue(ctx, outbox.RequeueFilter{EventIDs: []string{"no-such-event", last}}); n != 1 || err != nil {
			t.Fatalf("by id: %d, %v; want 1", n, err)
		}
		for _, r := range b.records(t) {
			if r.DeliveryState != "pending" || r.DeliveryAttempts != 0 {
				t.Fatalf("row after requeue: %s with %d attempts, want pending with 0", r.DeliveryState, r.DeliveryAttempts)
			}
		}
	})
}

func TestCleanupDeletesOnlyOldDeliveredRows(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		publishN(t, b.db, "a", 5)
		old := time.Now().Add(-8 * 24 * time.Hour).UTC()
		recent := time.Now().Add(-time.Hour).UTC()
		mustNil(t, b.db.Exec(`UPDATE outbox_records SET delivery_state = 'delivered', delivered_at = ? WHERE aggregate_sequence <= 3`, old).Error)
		mustNil(t, b.db.Exec(`UPDATE outbox_records SET delivery_state = 'delivered', delivered_at = ? WHERE aggregate_sequence = 4`, recent).Error)
		mustNil(t, b.db.Exec(`UPDATE outbox_records SET delivery_state = 'failed', updated_at = ? WHERE aggregate_sequence = 5`, old).Error)
		d := newDispatcher(t, b.db, &recorder{}, outbox.WithSweepLimit(2))
		n, err := d.Cleanup(context.Background())
		if err != nil || n != 3 {
			t.Fatalf("Cleanup = %d, %v; want 3 in batches of 2", n, err)
		}
		var seqs []int64
		for _, r := range b.records(t) {
			seqs = append(seqs, r.AggregateSequence)
		}
		if fmt.Sprint(seqs) != "[4 5]" {
			t.Fatalf("rows left %v, want the recent delivered one and the failed one", seqs)
		}
		// The sequence continues after cleanup.
		publishN(t, b.db, "a", 1)
		if rs := b.records(t); rs[len(rs)-1].AggregateSequence != 6 {
			t.Fatalf("next sequence %d after cleanup, want 6", rs[len(rs)-1].AggregateSequence)
		}
	})
}

func TestUncommittedEventIsNeverClaimed(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		rec := &recorder{}
		d := newDispatcher(t, b.db, rec)
		tx := b.db.Begin()
		mustNil(t, tx.Create(&Order{Status: "open"}).Error)
		// SQLite has one writer, so there the claim waits for the open
		// transaction: give it a dispatcher that waits only briefly.
		// PostgreSQL claims around the open transaction.
		impatient := d
		if e == outboxtest.SQLite {
			db := outboxtest.Reopen(t, outboxtest.DB{Engine: e, DSN: strings.Replace(b.info.DSN, "_busy_timeout=10000", "_busy_timeout=200", 1)}, nil)
			impatient = newDispatcher(t, db, rec)
		}
		n, _ := impatient.DispatchOnce(context.Background())
		if n != 0 || len(rec.Batches()) != 0 {
			t.Fatalf("an uncommitted event was published")
		}
		mustNil(t, tx.Rollback().Error)
		if n := dispatch(t, d); n != 0 || len(rec.Batches()) != 0 {
			t.Fatalf("a rolled-back event was published")
		}
		mustNil(t, b.db.Create(&Order{Status: "committed"}).Error)
		if n := dispatch(t, d); n != 1 {
			t.Fatalf("delivered %d after commit, want 1", n)
		}
	})
}

func TestLateSettleDoesNotOverwriteNewerClaim(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		publishN(t, b.db, "a", 1)
		inPublish, release := make(chan struct{}), make(chan struct{})
		slow := outbox.PublisherFunc(func(ctx context.Context, _ outbox.Batch) error {
			close(inPublish)
			<-release
			return errors.New("too late")
		})
		d1 := newDispatcher(t, b.db, slow, outbox.WithPublishTimeout(time.Minute), outbox.WithLease(2*time.Minute))
		done := make(chan error, 1)
		go func() { _, err := d1.DispatchOnce(context.Background()); done <- err }()
		<-inPublish
		// The lease runs out while d1 is still publishing; d2 takes over.
		mustNil(t, b.db.Exec(`UPDATE outbox_records SET next_attempt_at = ?, locked_until = ?`, time.Now().Add(-time.Second).UTC(), time.Now().Add(-time.Second).UTC()).Error)
		rec := &recorder{}
		if n := dispatch(t, newDispatcher(t, b.db, rec)); n != 1 {
			t.Fatalf("the second dispatcher delivered %d, want 1", n)
		}
		close(release)
		mustNil(t, <-done)
		r := b.records(t)[0]
		if r.DeliveryState != "delivered" || r.BatchID.String != rec.Batches()[0].ID || r.LastError.Valid {
			t.Fatalf("row %s (batch %s, error %q): the late settle overwrote the newer claim", r.DeliveryState, r.BatchID.String, r.LastError.String)
		}
	})
}

func TestPublisherPanicIsRecoveredAndRetried(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		publishN(t, b.db, "a", 1)
		d := newDispatcher(t, b.db, outbox.PublisherFunc(func(context.Context, outbox.Batch) error { panic("boom") }))
		mustNil(t, errOf(d.DispatchOnce(context.Background())))
		r := b.records(t)[0]
		if r.DeliveryState != "retry" || !strings.Contains(r.LastError.String, "boom") {
			t.Fatalf("row %s with error %q, want retry mentioning the panic", r.DeliveryState, r.LastError.String)
		}
	})
}

func TestHangingPublisherIsAbandonedAtDeadline(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		publishN(t, b.db, "a", 1)
		hang := make(chan struct{})
		defer close(hang)
		d := newDispatcher(t, b.db, outbox.PublisherFunc(func(context.Context, outbox.Batch) error { <-hang; return nil }),
			outbox.WithPublishTimeout(50*time.Millisecond))
		mustNil(t, errOf(d.DispatchOnce(context.Background())))
		r := b.records(t)[0]
		if r.DeliveryState != "retry" || !strings.Contains(r.LastError.String, "deadline") {
			t.Fatalf("row %s with error %q, want retry after the deadline", r.DeliveryState, r.LastError.String)
		}
	})
}

func TestRunStopsAfterSettlingBatchInFlight(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		publishN(t, b.db, "a", 2)
		inPublish, release := make(chan struct{}), make(chan struct{})
		p := outbox.PublisherFunc(func(ctx context.Context, _ outbox.Batch) error {
			close(inPublish)
			<-release
			return nil
		})
		d := newDispatcher(t, b.db, p)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- d.Run(ctx) }()
		<-inPublish
		cancel()
		close(release)
		mustNil(t, <-done)
		if s := fmt.Sprint(states(t, b)); s != "[delivered delivered]" {
			t.Fatalf("states after stop %s, want the in-flight batch settled", s)
		}
	})
}

func TestRunDeliversWhatIsWrittenWhileItRuns(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		got := make(chan outbox.Message, 100)
		p := outbox.PublisherFunc(func(_ context.Context, batch outbox.Batch) error {
			for _, m := range batch.Messages {
				got <- m
			}
			return nil
		})
		d := newDispatcher(t, b.db, p, outbox.WithPollInterval(20*time.Millisecond), outbox.WithBatchSize(3))
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- d.Run(ctx) }()
		publishN(t, b.db, "a", 10)
		for i := 1; i <= 10; i++ {
			if m := <-got; m.Sequence != int64(i) {
				t.Fatalf("message %d has sequence %d", i, m.Sequence)
			}
		}
		cancel()
		mustNil(t, <-done)
	})
}

// TestConcurrentDispatchersDeliverEachEventOnceInOrder runs four
// dispatchers on one table, with a publisher that fails now and then and
// accepts batches partly, and checks that per aggregate the first
// acceptances are 1, 2, 3, ... and that nothing is lost or claimed twice
// while its lease lives.
func TestConcurrentDispatchersDeliverEachEventOnceInOrder(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) { concurrentDispatchers(t, e, 6, 40, false) })
}

// TestConcurrentDispatchersClaimingByShardDeliverEachEventOnceInOrder is
// TestConcurrentDispatchersDeliverEachEventOnceInOrder with dispatchers
// that begin by claiming from shards of the aggregates, as they do once
// they hold each other back, and move between the shards and every
// aggregate as their claims find them.
func TestConcurrentDispatchersClaimingByShardDeliverEachEventOnceInOrder(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) { concurrentDispatchers(t, e, 24, 15, true) })
}

func concurrentDispatchers(t *testing.T, e outboxtest.Engine, aggregates, perAggregate int, byShard bool) {
	b := setup(t, e, nil)
	for range perAggregate {
		for a := range aggregates {
			publishN(t, b.db, fmt.Sprint(a), 1)
		}
	}
	var (
		mu       sync.Mutex
		order    deliveries.OrderChecker
		calls    int
		inFlight = map[string]bool{}
	)
	flaky := outbox.PublisherFunc(func(_ context.Context, batch outbox.Batch) error {
		mu.Lock()
		defer mu.Unlock()
		calls++
		for _, m := range batch.Messages {
			if inFlight[m.EventID] {
				t.Errorf("event %s handed to two dispatchers at once", m.EventID)
			}
		}
		if calls%5 == 0 {
			return errors.New("transient")
		}
		failed := map[string]error{}
		stopped := map[string]bool{}
		for i, m := range batch.Messages {
			if stopped[m.AggregateID] {
				failed[m.EventID] = outbox.ErrNotAttempted
				continue
			}
			if (calls+i)%7 == 0 {
				failed[m.EventID] = errors.New("partial")
				stopped[m.AggregateID] = true
				continue
			}
			if err := order.Accept(m); err != nil {
				t.Error(err)
			}
		}
		if len(failed) > 0 {
			return &outbox.PartialError{Failed: failed}
		}
		return nil
	})
	zero := outbox.RetryPolicyFunc(func(int, error) time.Duration { return 0 })
	var wg sync.WaitGroup
	deadline := time.Now().Add(60 * time.Second)
	for i := range 4 {
		db := outboxtest.Reopen(t, b.info, nil)
		mustNil(t, db.Use(outbox.Plugin()))
		d := newDispatcher(t, db, flaky, outbox.WithBatchSize(7), outbox.WithRetryPolicy(zero),
			outbox.WithMaxAttempts(1000), outbox.WithPollInterval(10*time.Millisecond))
		if byShard {
			outbox.ClaimByShard(d, 2*i)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(deadline) {
				if _, err := d.DispatchOnce(context.Background()); err != nil {
					t.Errorf("DispatchOnce: %v", err)
					return
				}
				var left int64
				if err := db.Raw(`SELECT count(*) FROM outbox_records WHERE delivery_state <> 'delivered'`).Scan(&left).Error; err != nil || left == 0 {
					return
				}
			}
		}()
	}
	wg.Wait()
	var aggs []string
	for a, n := range order.Accepted() {
		if n != int64(perAggregate) {
			t.Errorf("aggregate %s: %d of %d events accepted", a, n, perAggregate)
		}
		aggs = append(aggs, a)
	}
	sort.Strings(aggs)
	if len(aggs) != aggregates {
		t.Fatalf("accepted events of %d aggregates, want %d", len(aggs), aggregates)
	}
}

func TestNewDispatcherValidatesOptions(t *testing.T) {
	db, _ := outboxtest.Open(t, outboxtest.SQLite, nil)
	p := &recorder{}
	cases := map[string][]outbox.DispatcherOption{
		"BatchSizeZero":           {outbox.WithBatchSize(0)},
		"BatchSizeHuge":           {outbox.WithBatchSize(10001)},
		"LeaseTiny":               {outbox.WithLease(time.Millisecond)},
		"PublishTimeoutZero":      {outbox.WithPublishTimeout(0)},
		"PublishTimeoutPastLease": {outbox.WithLease(time.Second), outbox.WithPublishTimeout(time.Second)},
		"PollZero":                {outbox.WithPollInterval(0)},
		"RetryNil":                {outbox.WithRetryPolicy(nil)},
		"MaxAttemptsZero":         {outbox.WithMaxAttempts(0)},
		"RetentionZero":           {outbox.WithRetention(0)},
		"SweepZero":               {outbox.WithSweepLimit(0)},
		"LoggerNil":               {outbox.WithLogger(nil)},
	}
	for name, opts := range cases {
		if _, err := outbox.NewDispatcher(db, p, opts...); !errors.Is(err, outbox.ErrInvalidOption) {
			t.Errorf("%s: err = %v, want ErrInvalidOption", name, err)
		}
	}
	if _, err := outbox.NewDispatcher(db, nil); !errors.Is(err, outbox.ErrInvalidOption) {
		t.Errorf("nil publisher: err = %v, want ErrInvalidOption", err)
	}
	for name, session := range map[string]*gorm.DB{
		"Begin":                db,
		"BeginWithPrepareStmt": db.Session(&gorm.Session{PrepareStmt: true}),
	} {
		tx := session.Begin() // one at a time: SQLite has one writer
		if _, err := outbox.NewDispatcher(tx.WithContext(context.Background()), p); !errors.Is(err, outbox.ErrInvalidOption) {
			t.Errorf("db inside a transaction (%s): err = %v, want ErrInvalidOption", name, err)
		}
		mustNil(t, tx.Rollback().Error)
	}
}

func TestDefaultRetryPolicyGrowsFiveFoldToADay(t *testing.T) {
	p := outbox.DefaultRetryPolicy()
	for attempts, base := range map[int]time.Duration{1: time.Minute, 2: 5 * time.Minute, 3: 25 * time.Minute, 4: 125 * time.Minute} {
		for range 50 {
			if got := p.Backoff(attempts, nil); got < base*8/10 || got > base*12/10 {
				t.Fatalf("Backoff(%d) = %v, want %v ±20%%", attempts, got, base)
			}
		}
	}
	for _, attempts := range []int{7, 30, 1000} {
		if got := p.Backoff(attempts, nil); got > 24*time.Hour || got < 19*time.Hour {
			t.Fatalf("Backoff(%d) = %v, want capped at 24h", attempts, got)
		}
	}
}

func errOf(_ int, err error) error { return err }

// unknownEngine is SQLite under another name: an engine the library does
// not support.
type unknownEngine struct{ gorm.Dialector }

func (unknownEngine) Name() string { return "sqlserver" }

func TestAnEngineItDoesNotSupportIsAnInvalidOption(t *testing.T) {
	dsn := outboxtest.SQLiteDSN(filepath.Join(t.TempDir(), "other.db"))
	db, err := gorm.Open(unknownEngine{outboxtest.Dialector(outboxtest.SQLite, dsn)}, &gorm.Config{})
	mustNil(t, err)
	if err := db.Use(outbox.Plugin()); !errors.Is(err, outbox.ErrInvalidOption) || !strings.Contains(err.Error(), `"sqlserver"`) {
		t.Errorf("Use(Plugin()) on sqlserver: err = %v, want ErrInvalidOption naming the engine", err)
	}
	if _, err := outbox.NewDispatcher(db, &recorder{}); !errors.Is(err, outbox.ErrInvalidOption) {
		t.Errorf("NewDispatcher on sqlserver: err = %v, want ErrInvalidOption", err)
	}
}
