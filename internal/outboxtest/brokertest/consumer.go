package brokertest

import (
	"testing"

	"github.com/cloudevents/sdk-go/v2/event"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest/deliveries"
)

// CheckDelivered checks the delivery promise on events, what a consumer
// read off the broker in the order it read it: every id of want is among
// them, no other id is (no event of a rolled-back transaction, none of
// another test), and the first copy of each aggregate's events came in
// sequence order 1, 2, 3, ...; a later copy of an event, a redelivery,
// may come at any point. It returns how many copies of each id the
// consumer read, for the caller to check what its broker promises about
// them.
func CheckDelivered(t testing.TB, events []*event.Event, want map[string]bool) map[string]int {
	t.Helper()
	copies := map[string]int{}
	var order deliveries.OrderChecker
	for _, e := range events {
		m := aggregateOf(t, e)
		copies[m.EventID]++
		if !want[m.EventID] {
			t.Errorf("event %s (%s/%s#%d) arrived but is not one the outbox committed", m.EventID, m.AggregateType, m.AggregateID, m.Sequence)
			continue
		}
		if err := order.Accept(m); err != nil {
			t.Errorf("first arrivals out of order: %v", err)
		}
	}
	missing := 0
	for id := range want {
		if copies[id] == 0 {
			missing++
			if missing <= 10 {
				t.Errorf("event %s never arrived", id)
			}
		}
	}
	if missing > 0 {
		t.Errorf("%d of %d events never arrived", missing, len(want))
	}
	return copies
}

// CheckEachOnce checks that copies, as CheckDelivered returns them, holds
// every event once: a broker that deduplicates left no second copy.
func CheckEachOnce(t testing.TB, copies map[string]int) {
	t.Helper()
	for id, n := range copies {
		if n != 1 {
			t.Errorf("event %s arrived %d times, want once", id, n)
		}
	}
}

// CheckInOrder checks that events, what a consumer read in the order it
// read it, are msgs, each once and nothing else, every aggregate's in
// sequence order.
func CheckInOrder(t testing.TB, events []*event.Event, msgs []outbox.Message) {
	t.Helper()
	CheckEachOnce(t, CheckDelivered(t, events, IDs(msgs)))
	if len(events) != len(msgs) {
		t.Errorf("consumer read %d messages, want %d", len(events), len(msgs))
	}
}

// CheckDuplicateBatch publishes one batch (events 1 and 2 of order/1, 1 of
// order/2) twice through p, as a dispatcher does when it published the
// batch but could not settle it, and checks that each publish succeeds
// and that read, what the broker then holds, is copies copies of each of
// the batch's events under its event id, and nothing else.
func CheckDuplicateBatch(t testing.TB, p outbox.Publisher, copies int, read func() []*event.Event) {
	t.Helper()
	msgs := []outbox.Message{Message("order/1", 1), Message("order/1", 2), Message("order/2", 1)}
	for round := 1; round <= 2; round++ {
		if err := Publish(t, p, msgs...); err != nil {
			t.Fatalf("Publish, round %d of 2: %v (a batch published again must be accepted)", round, err)
		}
	}
	got := map[string]int{}
	events := read()
	for _, e := range events {
		got[e.ID()]++
	}
	for _, m := range msgs {
		if got[m.EventID] != copies {
			t.Errorf("event %s arrived %d times after the batch was published twice, want %d", m.EventID, got[m.EventID], copies)
		}
		delete(got, m.EventID)
	}
	if len(got) != 0 {
		t.Errorf("the broker holds events the batch does not: %v", got)
	}
	if len(events) != copies*len(msgs) {
		t.Errorf("the broker holds %d messages, want %d", len(events), copies*len(msgs))
	}
}
