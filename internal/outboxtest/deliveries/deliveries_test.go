package deliveries

import (
	"context"
	"errors"
	"testing"

	"github.com/gorm-outbox/outbox"
)

func msg(agg string, seq int64) outbox.Message {
	return outbox.Message{EventID: agg + string(rune('0'+seq)), AggregateType: "t", AggregateID: agg, Sequence: seq}
}

func TestOrderCheckerAllowsRedeliveriesAndRefusesJumps(t *testing.T) {
	var c OrderChecker
	for _, m := range []outbox.Message{msg("a", 1), msg("b", 1), msg("a", 2), msg("a", 1), msg("a", 3)} {
		if err := c.Accept(m); err != nil {
			t.Fatalf("Accept(%s#%d): %v", m.AggregateID, m.Sequence, err)
		}
	}
	if err := c.Accept(msg("b", 3)); err == nil {
		t.Fatal("b#3 before b#2 was accepted without an error")
	}
	if got := c.Accepted(); got["t/a"] != 3 || got["t/b"] != 1 {
		t.Fatalf("Accepted() = %v, want a: 3, b: 1", got)
	}
}

func TestRecorderCountsWhatAPartialErrorDoesNotName(t *testing.T) {
	r := &Recorder{Next: func(b outbox.Batch) error {
		return &outbox.PartialError{Failed: map[string]error{b.Messages[1].EventID: errors.New("no")}}
	}}
	_ = r.Publish(context.Background(), outbox.Batch{ID: "b1", Messages: []outbox.Message{msg("a", 1), msg("a", 2)}})
	if got := r.AcceptedIDs(); len(got) != 1 || got[0] != "t/a#1" {
		t.Fatalf("accepted %v, want a#1 only", got)
	}
	if got := r.BatchIDs(); len(got) != 1 || len(got[0]) != 2 {
		t.Fatalf("batches %v, want one of two", got)
	}
}
