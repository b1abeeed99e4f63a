package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// TestCancelledDispatchIsNotAnAttempt stops DispatchOnce while its
// publisher is publishing a batch of a new message (a#1) and of one that
// failed twice before (b#1). DispatchOnce returns an error wrapping the
// context's; nothing the publisher did not accept counts an attempt or
// waits for a backoff: the very next round delivers a#1 as attempt 1 and
// b#1 as attempt 3.
func TestCancelledDispatchIsNotAnAttempt(t *testing.T) {
	cases := []struct {
		name string
		// publish runs once ctx has been cancelled (or has passed its
		// deadline); batch is what it was handed.
		publish func(ctx context.Context, batch outbox.Batch) error
		// deadline ends the round by a deadline of the caller's instead
		// of a cancel.
		deadline bool
		// delivered is what the cancelled round delivered.
		delivered []string
	}{
		{name: "publisher returns the context's error",
			publish: func(ctx context.Context, _ outbox.Batch) error { return ctx.Err() }},
		{name: "publisher returns an error of its own",
			publish: func(context.Context, outbox.Batch) error { return errors.New("broker: connection closed") }},
		{name: "publisher returns a permanent error",
			publish: func(context.Context, outbox.Batch) error { return outbox.Permanent(errors.New("broker: closing")) }},
		{name: "caller's deadline passes",
			publish: func(ctx context.Context, _ outbox.Batch) error { return ctx.Err() }, deadline: true},
		{name: "publisher accepted part of the batch",
			publish: func(ctx context.Context, batch outbox.Batch) error {
				return &outbox.PartialError{Failed: map[string]error{batch.Messages[1].EventID: ctx.Err()}}
			},
			delivered: []string{"a"}},
		{name: "publisher accepted the whole batch",
			publish:   func(context.Context, outbox.Batch) error { return nil },
			delivered: []string{"a", "b"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
				b := setup(t, e, nil)
				publishN(t, b.db, "a", 1)
				publishN(t, b.db, "b", 1)
				mustNil(t, b.db.Exec(`UPDATE outbox_records SET delivery_state = 'retry', delivery_attempts = 2, last_error = 'earlier failure' WHERE aggregate_id = 'b'`).Error)

				cancelled := true
				var second []outbox.Message
				p := outbox.PublisherFunc(func(ctx context.Context, batch outbox.Batch) error {
					if !cancelled {
						second = batch.Messages
						return nil
					}
					<-ctx.Done() // until the round is stopped
					return tc.publish(ctx, batch)
				})
				d := newDispatcher(t, b.db, p)
				ctx, cancel := context.WithCancel(context.Background())
				want := context.Canceled
				if tc.deadline {
					ctx, cancel = context.WithTimeout(context.Background(), 200*time.Millisecond)
					want = context.DeadlineExceeded
				} else {
					time.AfterFunc(200*time.Millisecond, cancel)
				}
				defer cancel()
				n, err := d.DispatchOnce(ctx)
				if len(tc.delivered) == 2 {
					want = nil // the round completed
				}
				if !errors.Is(err, want) {
					t.Fatalf("DispatchOnce returned %v, want an error wrapping %v", err, want)
				}
				if n != len(tc.delivered) {
					t.Fatalf("DispatchOnce delivered %d, want %d", n, len(tc.delivered))
				}

				type row struct {
					State    string
					Attempts int
					LastErr  string
				}
				var rows []row
				for _, r := range b.records(t) {
					rows = append(rows, row{r.DeliveryState, r.DeliveryAttempts, r.LastError.String})
				}
				wantRows := []row{{"pending", 0, ""}, {"retry", 2, "earlier failure"}}
				if len(tc.delivered) > 0 {
					wantRows[0] = row{"delivered", 1, ""}
				}
				if len(tc.delivered) > 1 {
					wantRows[1] = row{"delivered", 3, ""}
				}
				if fmt.Sprint(rows) != fmt.Sprint(wantRows) {
					t.Fatalf("rows after the cancelled round %v, want %v: no attempt counted", rows, wantRows)
				}

				cancelled = false
				dispatch(t, d)
				var got []string
				for _, m := range second {
					got = append(got, fmt.Sprintf("%s attempt %d", m.AggregateID, m.Attempt))
				}
				wantNext := map[int]string{0: "[a attempt 1 b attempt 3]", 1: "[b attempt 3]", 2: "[]"}[len(tc.delivered)]
				if fmt.Sprint(got) != wantNext {
					t.Fatalf("the next round published %v, want %s at once", got, wantNext)
				}
			})
		})
	}
}

// TestDispatchCancelledBeforePublishCallsNoPublisher ends the round's
// context as its claim returns: the publisher is not called, and the
// claimed messages are due again at once, with no attempt counted.
func TestDispatchCancelledBeforePublishCallsNoPublisher(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		publishN(t, b.db, "a", 1)
		rec := &recorder{}
		d := newDispatcher(t, b.db, rec)
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		if _, err := d.DispatchOnce(ctx); !errors.Is(err, context.Canceled) {
			t.Fatalf("DispatchOnce returned %v, want an error wrapping context.Canceled", err)
		}
		if len(rec.Batches()) != 0 {
			t.Fatalf("the publisher was handed %d batches under a cancelled context", len(rec.Batches()))
		}
		if r := b.records(t)[0]; r.DeliveryState != "pending" || r.DeliveryAttempts != 0 {
			t.Fatalf("row %s after %d attempts, want pending after 0", r.DeliveryState, r.DeliveryAttempts)
		}
		if n := dispatch(t, d); n != 1 {
			t.Fatalf("the next round delivered %d, want 1 at once", n)
		}
	})
}

// TestCancelledDispatchWithPublisherIgnoringItsContext stops a round
// whose publisher ignores its context: the publisher is abandoned, and its
// message is due again at once with no attempt counted.
func TestCancelledDispatchWithPublisherIgnoringItsContext(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		publishN(t, b.db, "a", 1)
		hang := make(chan struct{})
		defer close(hang)
		var published atomic.Bool
		p := outbox.PublisherFunc(func(context.Context, outbox.Batch) error {
			if !published.Swap(true) {
				<-hang
			}
			return nil
		})
		d := newDispatcher(t, b.db, p)
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		defer cancel()
		if _, err := d.DispatchOnce(ctx); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("DispatchOnce returned %v, want an error wrapping context.DeadlineExceeded", err)
		}
		if r := b.records(t)[0]; r.DeliveryState != "pending" || r.DeliveryAttempts != 0 {
			t.Fatalf("row %s after %d attempts, want pending after 0", r.DeliveryState, r.DeliveryAttempts)
		}
		if n := dispatch(t, d); n != 1 {
			t.Fatalf("the next round delivered %d, want 1 at once", n)
		}
	})
}

// TestStoppingRunOrSchedulerMidPublishCancelsNoPublish stops Run, and a
// Scheduler, while their publisher publishes: the publish is not
// cancelled, and its batch is settled as the publisher answers (here
// delivered, at attempt 1) before Run returns or Stop does.
func TestStoppingRunOrSchedulerMidPublishCancelsNoPublish(t *testing.T) {
	stoppers := []struct {
		name  string
		start func(t *testing.T, d *outbox.Dispatcher) (stop func() error)
	}{
		{"Run", func(t *testing.T, d *outbox.Dispatcher) func() error {
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- d.Run(ctx) }()
			return func() error { cancel(); return <-done }
		}},
		{"Scheduler", func(t *testing.T, d *outbox.Dispatcher) func() error {
			s, err := outbox.NewScheduler(d, outbox.Schedule{Dispatch: "@every 1s"})
			mustNil(t, err)
			s.Start()
			return func() error { return s.Stop(context.Background()) }
		}},
	}
	for _, st := range stoppers {
		t.Run(st.name, func(t *testing.T) {
			outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
				b := setup(t, e, nil)
				publishN(t, b.db, "a", 1)
				inPublish, release := make(chan struct{}), make(chan struct{})
				var publishCtxErr error
				p := outbox.PublisherFunc(func(ctx context.Context, _ outbox.Batch) error {
					close(inPublish)
					<-release
					publishCtxErr = ctx.Err()
					return ctx.Err()
				})
				stop := st.start(t, newDispatcher(t, b.db, p))
				<-inPublish
				stopped := make(chan error, 1)
				go func() { stopped <- stop() }()
				select {
				case err := <-stopped:
					t.Fatalf("stopped (%v) before the batch in flight was settled", err)
				case <-time.After(100 * time.Millisecond):
				}
				close(release)
				mustNil(t, <-stopped)
				if publishCtxErr != nil {
					t.Fatalf("the publish's context ended (%v) when its dispatcher was stopped", publishCtxErr)
				}
				if r := b.records(t)[0]; r.DeliveryState != "delivered" || r.DeliveryAttempts != 1 {
					t.Fatalf("row %s after %d attempts, want delivered at attempt 1", r.DeliveryState, r.DeliveryAttempts)
				}
			})
		})
	}
}
