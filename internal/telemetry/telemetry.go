// Package telemetry holds what the outboxprom and outboxotel packages share:
// how a publish's outcome is classified per message (the dispatcher's own
// rules), the bound on event type labels, the cached reading of
// [outbox.Dispatcher.Stats], and the histogram buckets. It has no
// dependency beyond the root package.
package telemetry

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/gorm-outbox/outbox"
)

// Outcome is what became of one message of a published batch, as the
// dispatcher settles it.
type Outcome int

// The outcomes, in the order of [Outcomes].
const (
	Accepted Outcome = iota
	Retry
	Permanent
	NotAttempted
	NumOutcomes // how many outcomes there are
)

// Outcomes are the label values of the outcomes, indexed by Outcome.
var Outcomes = [NumOutcomes]string{"accepted", "retry", "permanent", "not_attempted"}

// String returns the outcome's label value.
func (o Outcome) String() string { return Outcomes[o] }

// States are the label values of outbox_messages, in the order Gauges
// returns them.
var States = [4]string{outbox.StatePending, outbox.StateDelivering, outbox.StateRetry, outbox.StateFailed}

// Gauges returns the counts of s in the order of States.
func Gauges(s outbox.Stats) [4]int64 {
	return [4]int64{s.Pending, s.Delivering, s.Retry, s.Failed}
}

// Classify returns the outcome of every message of b given what the
// publisher returned, by the rules the dispatcher settles with (settle.go):
// nil accepts every message; a *PartialError (possibly wrapped) gives each
// message the outcome of its own error, and a message it accepts after a
// failed one of the same aggregate is put back as not attempted; any other
// error is every message's.
func Classify(b outbox.Batch, err error) []Outcome {
	out := make([]Outcome, len(b.Messages))
	if err == nil {
		return out
	}
	var partial *outbox.PartialError
	if !errors.As(err, &partial) {
		o := errorOutcome(err)
		for i := range out {
			out[i] = o
		}
		return out
	}
	type aggregate struct{ typ, id string }
	var failed map[aggregate]bool
	for i, m := range b.Messages {
		agg := aggregate{m.AggregateType, m.AggregateID}
		switch merr := partial.Failed[m.EventID]; {
		case merr != nil:
			out[i] = errorOutcome(merr)
			if failed == nil {
				failed = map[aggregate]bool{}
			}
			failed[agg] = true
		case failed[agg]:
			out[i] = NotAttempted
		}
	}
	return out
}

// errorOutcome classifies the error of one message: ErrNotAttempted first,
// as the dispatcher checks it first, then Permanent, else a retry.
func errorOutcome(err error) Outcome {
	switch {
	case errors.Is(err, outbox.ErrNotAttempted):
		return NotAttempted
	case outbox.IsPermanent(err):
		return Permanent
	}
	return Retry
}

// ErrPublisherDidNotReturn is the outcome recorded for a batch whose
// publisher panicked (or ended its goroutine): the dispatcher retries it.
var ErrPublisherDidNotReturn = errors.New("publisher did not return")

// Other is the event type label of the event types beyond the bound
// (outboxprom.OtherEventType, outboxotel.OtherEventType).
const Other = "other"

// ByType keeps one T per event type label: the first Max distinct event
// types seen get their own, every later one shares the T of [Other]. It is
// safe for concurrent use.
type ByType[T any] struct {
	max  int
	make func(label string) T

	mu    sync.RWMutex
	m     map[string]T
	other *T
}

// NewByType returns a ByType that makes the T of a label with mk.
func NewByType[T any](max int, mk func(label string) T) *ByType[T] {
	return &ByType[T]{max: max, make: mk, m: make(map[string]T)}
}

// Get returns the T of eventType's label.
func (b *ByType[T]) Get(eventType string) T {
	b.mu.RLock()
	v, ok := b.m[eventType]
	b.mu.RUnlock()
	if ok {
		return v
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if v, ok := b.m[eventType]; ok {
		return v
	}
	if len(b.m) < b.max {
		v = b.make(eventType)
		b.m[eventType] = v
		return v
	}
	if b.other == nil {
		o := b.make(Other)
		b.other = &o
	}
	return *b.other
}

// StatsCache reads a dispatcher's Stats at most once per interval: every
// reading within the interval gets the last result, error included, so
// that scrapes cost at most one Stats per interval however many come.
// Concurrent readers wait for one query. It is safe for concurrent use.
type StatsCache struct {
	d       *outbox.Dispatcher
	ttl     time.Duration
	timeout time.Duration

	mu  sync.Mutex
	at  time.Time
	s   outbox.Stats
	err error
}

// NewStatsCache returns a cache of d.Stats for ttl (0 reads every time),
// each read bounded by timeout.
func NewStatsCache(d *outbox.Dispatcher, ttl, timeout time.Duration) *StatsCache {
	return &StatsCache{d: d, ttl: ttl, timeout: timeout}
}

// Get returns d.Stats as read at most ttl ago.
func (c *StatsCache) Get(ctx context.Context) (outbox.Stats, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.at.IsZero() && time.Since(c.at) < c.ttl {
		return c.s, c.err
	}
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	c.s, c.err = c.d.Stats(ctx)
	c.at = time.Now()
	return c.s, c.err
}

// OldestDueAge is outbox_oldest_due_age_seconds: how long the oldest due
// message of s has waited at now, 0 when none is due.
func OldestDueAge(s outbox.Stats, now time.Time) float64 {
	if s.OldestDue.IsZero() {
		return 0
	}
	return max(0, now.Sub(s.OldestDue).Seconds())
}

// Histogram buckets, in the unit of each histogram.
var (
	// DurationBuckets (seconds) span a fast in-process publish to the
	// default publish timeout of 10s.
	DurationBuckets = []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10}
	// BatchBuckets (messages) span one message to the largest batch size.
	BatchBuckets = []float64{1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000}
	// LagBuckets (seconds) span a few milliseconds to an hour.
	LagBuckets = []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600}
)
