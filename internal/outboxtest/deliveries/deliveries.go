// Package deliveries holds the suite's one recording publisher and one
// ordering checker, shared by the root package's tests and every
// publisher package's. (It lives apart from outboxtest, which the root
// package's own internal tests import, because it needs the root's types.)
package deliveries

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/gorm-outbox/outbox"
)

// Recorder is a Publisher that records every batch it is handed and every
// message it accepts. It answers each batch with what Next returns (nil,
// the default, accepts all of it); with a *outbox.PartialError, the
// messages it does not name count as accepted. It is safe for concurrent
// use.
type Recorder struct {
	// Next decides the outcome of each batch; it runs under the
	// recorder's lock, so it may keep state of its own without one.
	Next func(b outbox.Batch) error

	mu       sync.Mutex
	batches  []outbox.Batch
	accepted []outbox.Message
}

// Publish implements outbox.Publisher.
func (r *Recorder) Publish(_ context.Context, b outbox.Batch) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.batches = append(r.batches, b)
	var err error
	if r.Next != nil {
		err = r.Next(b)
	}
	var partial *outbox.PartialError
	for _, m := range b.Messages {
		if err == nil || (errors.As(err, &partial) && partial.Failed[m.EventID] == nil) {
			r.accepted = append(r.accepted, m)
		}
	}
	return err
}

// Batches returns the batches handed to the recorder, in order.
func (r *Recorder) Batches() []outbox.Batch {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]outbox.Batch(nil), r.batches...)
}

// Accepted returns the messages accepted, in the order they were.
func (r *Recorder) Accepted() []outbox.Message {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]outbox.Message(nil), r.accepted...)
}

// AcceptedIDs lists the accepted messages as aggregate_type/aggregate_id#sequence.
func (r *Recorder) AcceptedIDs() []string {
	var ids []string
	for _, m := range r.Accepted() {
		ids = append(ids, fmt.Sprintf("%s/%s#%d", m.AggregateType, m.AggregateID, m.Sequence))
	}
	return ids
}

// BatchIDs lists each batch handed to the recorder as aggregate_id#sequence.
func (r *Recorder) BatchIDs() [][]string {
	var out [][]string
	for _, b := range r.Batches() {
		var ids []string
		for _, m := range b.Messages {
			ids = append(ids, fmt.Sprintf("%s#%d", m.AggregateID, m.Sequence))
		}
		out = append(out, ids)
	}
	return out
}

// OrderChecker checks the ordering promise on acceptances as they happen:
// per aggregate, the first acceptance of each sequence comes in the order
// 1, 2, 3, ... (a redelivery of an earlier sequence is allowed; a sequence
// accepted before the one before it was is not). It is safe for concurrent
// use.
type OrderChecker struct {
	mu   sync.Mutex
	next map[[2]string]int64 // the first sequence not yet accepted, per aggregate
}

// Accept records the acceptance of m and reports a violation of the
// ordering promise, if it is one.
func (c *OrderChecker) Accept(m outbox.Message) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.next == nil {
		c.next = map[[2]string]int64{}
	}
	k := [2]string{m.AggregateType, m.AggregateID}
	want := c.next[k]
	if want == 0 {
		want = 1
	}
	switch {
	case m.Sequence > want:
		return fmt.Errorf("%s/%s: sequence %d accepted before %d", m.AggregateType, m.AggregateID, m.Sequence, want)
	case m.Sequence == want:
		c.next[k] = want + 1
	}
	return nil
}

// Accepted returns how many sequences of each aggregate ("type/id") were
// accepted, without a gap from 1.
func (c *OrderChecker) Accepted() map[string]int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(map[string]int64, len(c.next))
	for k, n := range c.next {
		out[k[0]+"/"+k[1]] = n - 1
	}
	return out
}
