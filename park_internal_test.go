package outbox

import (
	"context"
	"fmt"
	"testing"
	"time"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// parkSetup opens a migrated database on e with n events of one aggregate,
// "dead", whose first is dead-lettered, and a dispatcher on it.
func parkSetup(t *testing.T, e outboxtest.Engine, n int) (*gorm.DB, *Dispatcher) {
	t.Helper()
	db, _ := outboxtest.Open(t, e, nil)
	if err := db.Use(Plugin()); err != nil {
		t.Fatal(err)
	}
	if err := AutoMigrate(db); err != nil {
		t.Fatal(err)
	}
	err := db.Transaction(func(tx *gorm.DB) error {
		for range n {
			if err := Publish(tx, Event{Type: "t", AggregateType: "agg", AggregateID: "dead"}); err != nil {
				return err
			}
		}
		return tx.Exec(`UPDATE outbox_records SET delivery_state = 'failed', delivery_attempts = 1 WHERE aggregate_sequence = 1`).Error
	})
	if err != nil {
		t.Fatal(err)
	}
	noop := PublisherFunc(func(context.Context, Batch) error { return nil })
	d, err := NewDispatcher(db, noop, WithLogger(outboxtest.Logger(t)), WithLease(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	return db, d
}

func mustExec(t *testing.T, db *gorm.DB, query string, args ...any) {
	t.Helper()
	if err := db.Exec(query, args...).Error; err != nil {
		t.Fatal(err)
	}
}

func forEngines(t *testing.T, fn func(t *testing.T, e outboxtest.Engine)) {
	for _, e := range outboxtest.Engines {
		t.Run(string(e), func(t *testing.T) { fn(t, e) })
	}
}

// A dead letter that a requeue brings back between parking's read and
// its write keeps the rows behind it due.
func TestParkLeavesTheRowsOfABlockerThatCameBackMeanwhile(t *testing.T) {
	forEngines(t, func(t *testing.T, e outboxtest.Engine) {
		ctx := context.Background()
		db, d := parkSetup(t, e, 3)
		now := time.Now() // one time for the read and the write, as parkBlocked does
		blockers, err := d.blockers(ctx, now)
		if err != nil || len(blockers) != 1 || blockers[0].sequence != 1 {
			t.Fatalf("blockers = %+v, %v; want the dead letter, sequence 1", blockers, err)
		}
		if n, err := d.Requeue(ctx, RequeueFilter{}); err != nil || n != 1 {
			t.Fatalf("Requeue = %d, %v; want 1", n, err)
		}
		if moved, err := d.park(ctx, blockers, now); err != nil || moved != 0 {
			t.Fatalf("park = %d, %v; want no row moved", moved, err)
		}
		for _, r := range outboxtest.Records(t, db, DefaultTable) {
			if r.NextAttemptAt.After(time.Now()) {
				t.Errorf("#%d parked until %v behind a dead letter that came back", r.AggregateSequence, r.NextAttemptAt)
			}
		}
	})
}

// Rows parked behind a dead letter come due again after a lease, behind
// the rows written meanwhile, which fill the window of due rows: parking
// must still find the dead letter, or no claim could take anything from
// that window until a requeue.
func TestParkFindsTheDeadLetterBehindAWindowFullOfRowsWrittenLater(t *testing.T) {
	forEngines(t, func(t *testing.T, e outboxtest.Engine) {
		ctx := context.Background()
		n := scanWindow(DefaultBatchSize) + 2
		db, d := parkSetup(t, e, n)
		// #2 was parked and has just come due; #3 onwards were written
		// while it was parked, so they come first in the due order.
		mustExec(t, db, `UPDATE outbox_records SET next_attempt_at = ? WHERE aggregate_sequence > 2`, d.d.TimeArg(time.Now().Add(-time.Hour)))
		mustExec(t, db, `UPDATE outbox_records SET next_attempt_at = ? WHERE aggregate_sequence = 2`, d.d.TimeArg(time.Now().Add(-time.Second)))

		d.parkBlocked(ctx)
		parked := 0
		for _, r := range outboxtest.Records(t, db, DefaultTable) {
			if r.AggregateSequence > 1 && r.NextAttemptAt.After(time.Now().Add(30*time.Minute)) {
				parked++
			}
		}
		if parked != n-1 {
			t.Fatalf("%d of the %d rows behind the dead letter parked, want all", parked, n-1)
		}
	})
}

// Requeue releases every row parked behind the dead letter it brings
// back, those in retry (not attempted by the dead letter's batch, after an
// attempt of their own) as well as those pending.
func TestRequeueReleasesTheRowsParkedBehindItsDeadLetter(t *testing.T) {
	forEngines(t, func(t *testing.T, e outboxtest.Engine) {
		ctx := context.Background()
		db, d := parkSetup(t, e, 3)
		mustExec(t, db, `UPDATE outbox_records SET delivery_state = 'retry', delivery_attempts = 1 WHERE aggregate_sequence = 2`)
		d.parkBlocked(ctx)
		for _, r := range outboxtest.Records(t, db, DefaultTable)[1:] {
			if !r.NextAttemptAt.After(time.Now().Add(30 * time.Minute)) {
				t.Fatalf("#%d (%s) not parked behind the dead letter: next attempt %v", r.AggregateSequence, r.DeliveryState, r.NextAttemptAt)
			}
		}
		if n, err := d.Requeue(ctx, RequeueFilter{}); err != nil || n != 1 {
			t.Fatalf("Requeue = %d, %v; want 1", n, err)
		}
		for _, r := range outboxtest.Records(t, db, DefaultTable) {
			if r.NextAttemptAt.After(time.Now()) {
				t.Errorf("#%d (%s) still parked until %v after Requeue", r.AggregateSequence, r.DeliveryState, r.NextAttemptAt)
			}
		}
	})
}

// A head whose retry has come due behind more rows of its aggregate than
// the window of due rows holds (written while it waited, and not parked)
// is outside every claim's window, and the window is full of rows no
// claim can take: parking moves them behind the head, and claims go on.
func TestParkMovesRowsThatCameDueBeforeTheirHeadBehindIt(t *testing.T) {
	forEngines(t, func(t *testing.T, e outboxtest.Engine) {
		ctx := context.Background()
		n := scanWindow(DefaultBatchSize) + 2
		db, d := parkSetup(t, e, n)
		mustExec(t, db, `UPDATE outbox_records SET delivery_state = 'retry', next_attempt_at = ? WHERE aggregate_sequence = 1`, d.d.TimeArg(time.Now().Add(-time.Second)))
		mustExec(t, db, `UPDATE outbox_records SET next_attempt_at = ? WHERE aggregate_sequence > 1`, d.d.TimeArg(time.Now().Add(-time.Hour)))

		if got, err := d.DispatchOnce(ctx); err != nil || got != 0 {
			t.Fatalf("first dispatch delivered %d, %v; want 0: the head is outside the window", got, err)
		}
		// That batch was not full, so the dispatch parked.
		if got, err := d.DispatchOnce(ctx); err != nil || got != DefaultBatchSize {
			t.Fatalf("second dispatch delivered %d, %v; want a full batch from the head on", got, err)
		}
		for _, r := range outboxtest.Records(t, db, DefaultTable)[:DefaultBatchSize] {
			if r.DeliveryState != "delivered" {
				t.Fatalf("#%d is %s; want the first %d delivered, in order", r.AggregateSequence, r.DeliveryState, DefaultBatchSize)
			}
		}
	})
}

// A head that comes first in due order blocks nothing: claims take it,
// and the rows behind it are left as they are.
func TestParkLeavesTheRowsBehindAHeadThatComesFirst(t *testing.T) {
	forEngines(t, func(t *testing.T, e outboxtest.Engine) {
		_, d := parkSetup(t, e, 3)
		mustExec(t, d.db, `UPDATE outbox_records SET delivery_state = 'retry', next_attempt_at = ? WHERE aggregate_sequence = 1`, d.d.TimeArg(time.Now().Add(-2*time.Hour)))
		mustExec(t, d.db, `UPDATE outbox_records SET next_attempt_at = ? WHERE aggregate_sequence > 1`, d.d.TimeArg(time.Now().Add(-time.Hour)))
		if blockers, err := d.blockers(context.Background(), time.Now()); err != nil || len(blockers) != 0 {
			t.Fatalf("blockers = %+v, %v; want none", blockers, err)
		}
	})
}

// A retried head comes after the rows behind it in due order. When they
// fill a claim's window, no claim reaches the head, or any row after the
// window: parking moves them behind the head, and claims go on, in order.
func TestClaimsGoOnWhenRowsComeDueBeforeTheirHead(t *testing.T) {
	forEngines(t, func(t *testing.T, e outboxtest.Engine) {
		db, _ := parkSetup(t, e, 3)
		if err := Publish(db, Event{Type: "t", AggregateType: "agg", AggregateID: "other"}); err != nil {
			t.Fatal(err)
		}
		now := time.Now()
		mustExec(t, db, `UPDATE outbox_records SET delivery_state = 'retry', next_attempt_at = ? WHERE aggregate_id = 'dead' AND aggregate_sequence = 1`, now.Add(-time.Second).UTC())
		mustExec(t, db, `UPDATE outbox_records SET next_attempt_at = ? WHERE aggregate_id = 'dead' AND aggregate_sequence > 1`, now.Add(-time.Hour).UTC())
		mustExec(t, db, `UPDATE outbox_records SET next_attempt_at = ? WHERE aggregate_id = 'other'`, now.Add(-time.Minute).UTC())
		var got []string
		pub := PublisherFunc(func(_ context.Context, b Batch) error {
			for _, m := range b.Messages {
				got = append(got, fmt.Sprintf("%s#%d", m.AggregateID, m.Sequence))
			}
			return nil
		})
		d, err := NewDispatcher(db, pub, WithLogger(outboxtest.Logger(t)), WithBatchSize(2))
		if err != nil {
			t.Fatal(err)
		}
		for range 4 {
			if _, err := d.Dispatch(context.Background()); err != nil {
				t.Fatal(err)
			}
		}
		if want := "[dead#1 other#1 dead#2 dead#3]"; fmt.Sprint(got) != want {
			t.Fatalf("published %v, want %s", got, want)
		}
	})
}

func TestRunClaimsAgainAtOnceAfterParking(t *testing.T) {
	forEngines(t, func(t *testing.T, e outboxtest.Engine) {
		// More rows behind the dead letter than a run claim looks at.
		db, _ := parkSetup(t, e, scanWindow(10)+2)
		if err := Publish(db, Event{Type: "t", AggregateType: "agg", AggregateID: "live"}); err != nil {
			t.Fatal(err)
		}
		delivered := make(chan string, 1)
		pub := PublisherFunc(func(_ context.Context, b Batch) error {
			for _, m := range b.Messages {
				delivered <- m.AggregateID
			}
			return nil
		})
		d, err := NewDispatcher(db, pub, WithLogger(outboxtest.Logger(t)), WithBatchSize(10),
			WithPollInterval(time.Hour), WithListen(false), WithLease(time.Hour))
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- d.Run(ctx) }()
		defer func() {
			cancel()
			if err := <-done; err != nil {
				t.Error(err)
			}
		}()
		select {
		case agg := <-delivered:
			if agg != "live" {
				t.Fatalf("delivered an event of %s, want live's", agg)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("live's event not delivered within 10s of a poll interval of an hour")
		}
	})
}

// A dispatcher killed mid-batch leaves its rows delivering with a lease
// that ends after the rows written behind them meanwhile. Once the lease
// has passed, the head must be claimed again even when more of those rows
// come before it in due order than a claim looks at.
func TestExpiredLeaseBehindADeepBacklogIsClaimedAgain(t *testing.T) {
	forEngines(t, func(t *testing.T, e outboxtest.Engine) {
		db, d := parkSetup(t, e, scanWindow(DefaultBatchSize)+100)
		ctx := context.Background()
		now := time.Now()
		mustExec(t, db, `UPDATE outbox_records SET delivery_state = 'delivering', batch_id = 'killed', locked_until = ?, next_attempt_at = ?
			WHERE aggregate_sequence = 1`, d.d.TimeArg(now.Add(-time.Second)), d.d.TimeArg(now.Add(-time.Second)))
		mustExec(t, db, `UPDATE outbox_records SET next_attempt_at = ? WHERE aggregate_sequence > 1`, d.d.TimeArg(now.Add(-time.Hour)))
		var state string
		for range 3 {
			if _, err := d.Dispatch(ctx); err != nil {
				t.Fatal(err)
			}
			if err := db.Raw(`SELECT delivery_state FROM outbox_records WHERE aggregate_sequence = 1`).Scan(&state).Error; err != nil {
				t.Fatal(err)
			}
			if state == StateDelivered {
				return
			}
		}
		t.Fatalf("#1 is %s after three dispatches, want delivered", state)
	})
}
