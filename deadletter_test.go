package outbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// deadLetter is a failed row as the sweep and a person see it.
type deadLetter struct {
	State, LastError string
	FailureKind      *string
	Revivals         int
}

func deadLetterOf(t *testing.T, b bundle) deadLetter {
	t.Helper()
	var dl deadLetter
	mustNil(t, b.db.Raw(`SELECT delivery_state AS state, coalesce(last_error, '') AS last_error, failure_kind, revivals FROM outbox_records`).Scan(&dl).Error)
	return dl
}

func TestRetryFailedSweepLeavesWhatFailedForGood(t *testing.T) {
	for _, tc := range []struct {
		name, lastError string
		publisher       outbox.Publisher
	}{
		{"a permanent error", "permanent: bad payload", outbox.PublisherFunc(func(context.Context, outbox.Batch) error {
			return outbox.Permanent(errors.New("bad payload"))
		})},
		{"no handler", `no handler for event type: "t"`, func() outbox.Publisher {
			h, err := outbox.NewHandlers()
			if err != nil {
				panic(err)
			}
			return h
		}()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
				b := setup(t, e, nil)
				publishN(t, b.db, "a", 1)
				d := newDispatcher(t, b.db, tc.publisher)
				dispatch(t, d)
				for range 3 {
					if n, err := d.RetryFailed(context.Background()); n != 0 || err != nil {
						t.Fatalf("RetryFailed = %d, %v; want 0: the event failed for good", n, err)
					}
				}
				dl := deadLetterOf(t, b)
				if dl.State != outbox.StateFailed || dl.FailureKind == nil || *dl.FailureKind != "permanent" || dl.Revivals != 0 {
					t.Fatalf("dead letter %+v, want failed, permanent, never revived", dl)
				}
				if !contains(dl.LastError, tc.lastError) {
					t.Fatalf("last_error %q, want it to say %q", dl.LastError, tc.lastError)
				}
				// A person may requeue it all the same.
				if n, err := d.Requeue(context.Background(), outbox.RequeueFilter{}); n != 1 || err != nil {
					t.Fatalf("Requeue = %d, %v; want 1", n, err)
				}
				if dl := deadLetterOf(t, b); dl.State != outbox.StatePending || dl.FailureKind != nil || !contains(dl.LastError, tc.lastError) {
					t.Fatalf("after Requeue: %+v, want pending with the last reason kept", dl)
				}
			})
		})
	}
}

func TestRetryFailedSweepRevivesAnExhaustedEventAtMostMaxRevivalsTimes(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		publishN(t, b.db, "a", 1)
		down := outbox.PublisherFunc(func(context.Context, outbox.Batch) error { return errors.New("broker down") })
		now := outbox.RetryPolicyFunc(func(int, error) time.Duration { return 0 })
		d := newDispatcher(t, b.db, down, outbox.WithMaxAttempts(2), outbox.WithMaxRevivals(2), outbox.WithRetryPolicy(now))
		ctx := context.Background()
		exhaust := func() {
			t.Helper()
			dispatch(t, d) // attempt 1: retry
			dispatch(t, d) // attempt 2: failed, out of attempts
			if dl := deadLetterOf(t, b); dl.State != outbox.StateFailed || dl.FailureKind == nil || *dl.FailureKind != "exhausted" {
				t.Fatalf("after two failed attempts: %+v, want failed, exhausted", dl)
			}
		}
		for revival := 1; revival <= 2; revival++ {
			exhaust()
			if n, err := d.RetryFailed(ctx); n != 1 || err != nil {
				t.Fatalf("revival %d: RetryFailed = %d, %v; want 1", revival, n, err)
			}
			if dl := deadLetterOf(t, b); dl.State != outbox.StatePending || dl.Revivals != revival || dl.LastError != "broker down" {
				t.Fatalf("after revival %d: %+v, want pending, revived %d times, the last reason kept", revival, dl, revival)
			}
		}
		exhaust()
		if n, err := d.RetryFailed(ctx); n != 0 || err != nil {
			t.Fatalf("after the last revival: RetryFailed = %d, %v; want 0, the event stays dead", n, err)
		}
		// A person's requeue resets the count, so the sweep helps again.
		if n, err := d.Requeue(ctx, outbox.RequeueFilter{}); n != 1 || err != nil {
			t.Fatalf("Requeue = %d, %v; want 1", n, err)
		}
		if dl := deadLetterOf(t, b); dl.Revivals != 0 {
			t.Fatalf("after Requeue: revived %d times, want 0", dl.Revivals)
		}
	})
}

func TestWithMaxRevivalsZeroTurnsTheSweepOff(t *testing.T) {
	b := setup(t, outboxtest.SQLite, nil)
	publishN(t, b.db, "a", 1)
	down := outbox.PublisherFunc(func(context.Context, outbox.Batch) error { return errors.New("down") })
	d := newDispatcher(t, b.db, down, outbox.WithMaxAttempts(1), outbox.WithMaxRevivals(0))
	dispatch(t, d)
	if n, err := d.RetryFailed(context.Background()); n != 0 || err != nil {
		t.Fatalf("RetryFailed = %d, %v; want 0", n, err)
	}
	if _, err := outbox.NewDispatcher(b.db, down, outbox.WithMaxRevivals(-1)); !errors.Is(err, outbox.ErrInvalidOption) {
		t.Fatalf("WithMaxRevivals(-1): %v, want ErrInvalidOption", err)
	}
}

func TestRowLeasedUntilTheFutureIsNeverClaimed(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		publishN(t, b.db, "a", 1)
		publishN(t, b.db, "b", 1)
		// An operator (or a tool) holds a's row: its lease lies ahead,
		// although its next attempt is due.
		mustNil(t, b.db.Exec(`UPDATE outbox_records SET delivery_state = 'delivering', locked_until = ?, next_attempt_at = ?
			WHERE aggregate_id = 'a'`, time.Now().Add(time.Hour).UTC(), time.Now().Add(-time.Hour).UTC()).Error)
		rec := &recorder{}
		dispatch(t, newDispatcher(t, b.db, rec))
		if got := rec.AcceptedIDs(); len(got) != 1 || got[0] != "agg/b#1" {
			t.Fatalf("accepted %v, want b's event only", got)
		}
		// Once the lease has passed, the row is claimed again.
		mustNil(t, b.db.Exec(`UPDATE outbox_records SET locked_until = ? WHERE aggregate_id = 'a'`, time.Now().Add(-time.Second).UTC()).Error)
		dispatch(t, newDispatcher(t, b.db, rec))
		if got := rec.AcceptedIDs(); len(got) != 2 || got[1] != "agg/a#1" {
			t.Fatalf("accepted %v, want a's event after its lease", got)
		}
	})
}

func contains(s, sub string) bool { return strings.Contains(s, sub) }
