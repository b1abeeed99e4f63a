package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
	"github.com/gorm-outbox/outbox/internal/outboxtest/deliveries"
)

// TestPublisherFaultsTogether runs two dispatchers against one publisher
// that fails in every way a publisher can, in one run over several
// aggregates: errors, timeouts longer than the publish deadline (honouring
// the context), hangs (ignoring it), panics, partial batches (a failed
// message, the rest of its aggregate not attempted, random messages not
// attempted), a poison event that always fails and a permanently rejected
// one. It checks that:
//   - every event of a healthy aggregate is delivered, first acceptances in
//     sequence order;
//   - panics are recovered, the batch retried and the dispatchers live;
//   - the poison event is dead-lettered after exactly its max attempts and
//     the permanently rejected one at once;
//   - neither blocks any other aggregate, while the later events of their
//     own aggregates are held back: never handed to the publisher again,
//     never dead-lettered, still waiting.
func TestPublisherFaultsTogether(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		const healthy, perAggregate, maxAttempts = 5, 12, 6
		aggs := []string{"poison", "perm"}
		for i := range healthy {
			aggs = append(aggs, fmt.Sprintf("h%d", i))
		}
		// Interleaved, so that batches mix aggregates.
		for range perAggregate {
			for _, a := range aggs {
				publishN(t, b.db, a, 1)
			}
		}
		// A crowd held back behind the poison event, larger than what one
		// claim looks at (8 scans of a batch), must not stall the others.
		const crowd = 80
		publishN(t, b.db, "poison", crowd)
		f := newFaultyPublisher()
		defer f.release()
		ctx, cancel := context.WithCancel(context.Background())
		var wg sync.WaitGroup
		running := make([]bool, 2)
		for i := range running {
			d := newDispatcher(t, b.db, f, outbox.WithBatchSize(8), outbox.WithMaxAttempts(maxAttempts),
				outbox.WithPublishTimeout(150*time.Millisecond), outbox.WithLease(5*time.Second), outbox.WithPollInterval(10*time.Millisecond),
				outbox.WithRetryPolicy(outbox.RetryPolicyFunc(func(int, error) time.Duration { return 10 * time.Millisecond })))
			running[i] = true
			wg.Add(1)
			go func() {
				defer wg.Done()
				mustNilNow(t, d.Run(ctx))
				f.mu.Lock()
				running[i] = false
				f.mu.Unlock()
			}()
		}

		// Wait until the healthy aggregates are delivered and the two bad
		// events are dead-lettered, then a little longer to see that
		// nothing else moves.
		deadline := time.Now().Add(30 * time.Second)
		for {
			var n int64
			mustNil(t, b.db.Raw(`SELECT count(*) FROM outbox_records WHERE (aggregate_id LIKE 'h%' AND delivery_state = 'delivered')
				OR (aggregate_id IN ('poison', 'perm') AND delivery_state = 'failed')`).Scan(&n).Error)
			if n == healthy*perAggregate+2 {
				break
			}
			if time.Now().After(deadline) {
				for _, r := range b.records(t) {
					t.Logf("%s/%s #%d: %s after %d attempts (%s)", r.AggregateType, r.AggregateID, r.AggregateSequence, r.DeliveryState, r.DeliveryAttempts, r.LastError.String)
				}
				t.Fatalf("healthy events not all delivered, or the bad ones not dead-lettered, after 30s")
			}
			time.Sleep(20 * time.Millisecond)
		}
		time.Sleep(300 * time.Millisecond)
		f.mu.Lock()
		alive := running[0] && running[1]
		f.mu.Unlock()
		if !alive {
			t.Errorf("a dispatcher stopped running before it was told to")
		}
		cancel()
		wg.Wait()

		f.mu.Lock()
		defer f.mu.Unlock()
		var order deliveries.OrderChecker
		for _, m := range f.accepted {
			if err := order.Accept(m); err != nil {
				t.Error(err)
			}
		}
		first := order.Accepted()
		for _, a := range aggs[2:] {
			if first["agg/"+a] != perAggregate {
				t.Errorf("healthy aggregate %s: %d of %d events accepted", a, first["agg/"+a], perAggregate)
			}
		}
		// The poison aggregate: #1 delivered, #2 dead-lettered after exactly
		// maxAttempts, the rest held back. The perm aggregate: #1
		// dead-lettered at once (unless a batch-wide fault hit it first),
		// the rest held back.
		for _, r := range b.records(t) {
			if r.AggregateID != "poison" && r.AggregateID != "perm" {
				if r.DeliveryState != outbox.StateDelivered {
					t.Errorf("%s #%d is %s, want delivered", r.AggregateID, r.AggregateSequence, r.DeliveryState)
				}
				continue
			}
			bad := int64(1)
			if r.AggregateID == "poison" {
				bad = 2
			}
			switch {
			case r.AggregateSequence < bad && r.DeliveryState != outbox.StateDelivered:
				t.Errorf("%s #%d is %s, want delivered", r.AggregateID, r.AggregateSequence, r.DeliveryState)
			case r.AggregateSequence == bad && r.DeliveryState != outbox.StateFailed:
				t.Errorf("%s #%d is %s, want failed (dead-lettered)", r.AggregateID, r.AggregateSequence, r.DeliveryState)
			case r.AggregateID == "poison" && r.AggregateSequence == bad && (r.DeliveryAttempts != maxAttempts || !strings.Contains(r.LastError.String, "poison")):
				t.Errorf("poison #2 dead-lettered after %d attempts with %q, want %d attempts and its error", r.DeliveryAttempts, r.LastError.String, maxAttempts)
			case r.AggregateID == "perm" && r.AggregateSequence == bad && !strings.Contains(r.LastError.String, "permanent"):
				t.Errorf("perm #1 dead-lettered with %q, want the permanent error", r.LastError.String)
			case r.AggregateSequence > bad && r.DeliveryState != outbox.StatePending && r.DeliveryState != outbox.StateRetry:
				t.Errorf("%s #%d is %s, want held back (pending or retry) behind the dead-lettered #%d", r.AggregateID, r.AggregateSequence, r.DeliveryState, bad)
			}
		}
		for _, m := range f.accepted {
			if (m.AggregateID == "poison" && m.Sequence > 2) || (m.AggregateID == "perm" && m.Sequence > 1) {
				t.Errorf("%s #%d was accepted past its dead-lettered predecessor", m.AggregateID, m.Sequence)
			}
		}
		if f.faults["permanent"] != 1 {
			t.Errorf("perm #1 was rejected permanently %d times, want once: dead-lettered at once", f.faults["permanent"])
		}
		for _, kind := range []string{"error", "timeout", "hang", "panic", "partial", "not attempted", "poison", "permanent"} {
			if f.faults[kind] == 0 {
				t.Errorf("the run had no %s", kind)
			}
		}
		var kinds []string
		for k, n := range f.faults {
			kinds = append(kinds, fmt.Sprintf("%s %d", k, n))
		}
		sort.Strings(kinds)
		summary(t, "publisher faults %s: %d publish calls, faults %v; %d healthy events all delivered in order, %d acceptances; poison event dead-lettered after %d attempts and permanent one at once, %d later events of theirs held back; dispatchers alive",
			e, f.calls, kinds, healthy*perAggregate, len(f.accepted), maxAttempts, 2*perAggregate-3+crowd)
	})
}

// faultyPublisher accepts what it is given, except when it decides to
// fail: the first calls each fail in a different way, later ones at
// random, but only while every message of the batch is on its first or
// second attempt, so that healthy events get through in the end.
type faultyPublisher struct {
	mu       sync.Mutex
	calls    int
	faults   map[string]int
	accepted []outbox.Message
	hung     chan struct{}
	once     sync.Once
}

func newFaultyPublisher() *faultyPublisher {
	return &faultyPublisher{faults: map[string]int{}, hung: make(chan struct{})}
}

// release lets hung publish calls return.
func (f *faultyPublisher) release() { f.once.Do(func() { close(f.hung) }) }

func (f *faultyPublisher) Publish(ctx context.Context, b outbox.Batch) error {
	f.mu.Lock()
	f.calls++
	call := f.calls
	fresh := true
	for _, m := range b.Messages {
		if m.Attempt > 2 {
			fresh = false
		}
	}
	kind := ""
	switch {
	case call <= 4:
		kind = []string{"error", "timeout", "hang", "panic"}[call-1]
	case fresh && rand.IntN(4) == 0:
		kind = []string{"error", "timeout", "hang", "panic"}[rand.IntN(4)]
	}
	if kind != "" {
		f.faults[kind]++
	}
	f.mu.Unlock()

	switch kind {
	case "error":
		return errors.New("broker unavailable")
	case "timeout":
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Minute):
			return errors.New("the deadline never came")
		}
	case "hang":
		<-f.hung
		return errors.New("released at the end of the test")
	case "panic":
		panic("publisher bug")
	}

	f.mu.Lock()
	defer f.mu.Unlock()
	failed := map[string]error{}
	stopped := map[string]bool{}
	for _, m := range b.Messages {
		switch {
		case stopped[m.AggregateID]:
			failed[m.EventID] = outbox.ErrNotAttempted
			f.faults["not attempted"]++
		case m.AggregateID == "poison" && m.Sequence == 2:
			failed[m.EventID] = errors.New("poison: the consumer cannot parse this event")
			stopped[m.AggregateID] = true
			f.faults["poison"]++
		case m.AggregateID == "perm" && m.Sequence == 1:
			failed[m.EventID] = outbox.Permanent(errors.New("schema rejected"))
			stopped[m.AggregateID] = true
			f.faults["permanent"]++
		case m.Attempt <= 2 && rand.IntN(8) == 0:
			failed[m.EventID] = errors.New("message rejected for now")
			stopped[m.AggregateID] = true
			f.faults["partial"]++
		case rand.IntN(12) == 0:
			failed[m.EventID] = outbox.ErrNotAttempted
			stopped[m.AggregateID] = true
			f.faults["not attempted"]++
		default:
			f.accepted = append(f.accepted, m)
		}
	}
	if len(failed) > 0 {
		return &outbox.PartialError{Failed: failed}
	}
	return nil
}

// mustNilNow reports err from any goroutine.
func mustNilNow(t *testing.T, err error) {
	if err != nil {
		t.Error(err)
	}
}
