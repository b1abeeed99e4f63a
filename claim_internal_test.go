package outbox

import (
	"context"
	"fmt"
	"testing"
)

func TestAcceptedSeqsKnowsOnlyTheLastAcceptedEventOfAnAggregate(t *testing.T) {
	a, b := aggregateKey{"agg", "a"}, aggregateKey{"agg", "b"}
	c := acceptedSeqs{limit: 10}
	c.add([]aggregateSeq{{a, 1}, {a, 3}, {a, 2}}, "")
	for _, tc := range []struct {
		agg  aggregateKey
		seq  int64
		want bool
	}{
		{a, 3, true},
		// Accepted too, but possibly out for a second delivery after a
		// late settle: a claim looks it up.
		{a, 2, false},
		{a, 4, false},
		{b, 1, false},
	} {
		if got := c.has(tc.agg, tc.seq); got != tc.want {
			t.Errorf("has(%v, %d) = %v, want %v", tc.agg, tc.seq, got, tc.want)
		}
	}
}

func TestAcceptedSeqsForgetsEverythingWhenFull(t *testing.T) {
	c := acceptedSeqs{limit: 3}
	first := aggregateKey{"agg", "first"}
	c.add([]aggregateSeq{{first, 1}, {aggregateKey{"agg", "second"}, 1}}, "")
	if !c.has(first, 1) {
		t.Fatal("forgot an aggregate before it was full")
	}
	c.add([]aggregateSeq{{aggregateKey{"agg", "third"}, 1}, {aggregateKey{"agg", "fourth"}, 1}}, "")
	if c.has(first, 1) {
		t.Error("still remembers an aggregate after it overflowed")
	}
	if len(c.seqs) > c.limit {
		t.Errorf("holds %d aggregates, limit %d", len(c.seqs), c.limit)
	}
	if !c.has(aggregateKey{"agg", "fourth"}, 1) {
		t.Error("forgot the events it was just told about")
	}
}

func TestPickOldestTakesEachAggregateFromItsFirstRowWithoutAGap(t *testing.T) {
	a, b := aggregateKey{"agg", "a"}, aggregateKey{"agg", "b"}
	w := func(id int64, agg aggregateKey, seq int64) windowRow { return windowRow{id: id, agg: agg, seq: seq} }
	for _, tc := range []struct {
		name   string
		window []windowRow // id, aggregate, sequence, in due order
		want   string      // ids taken, in due order
	}{
		{"in order", []windowRow{w(1, a, 1), w(2, a, 2), w(3, a, 3)}, "[1 2 3]"},
		{"out of order in the window", []windowRow{w(2, a, 2), w(1, a, 1), w(3, a, 3)}, "[2 1 3]"},
		{"up to a gap", []windowRow{w(1, a, 1), w(3, a, 3), w(4, a, 4)}, "[1]"},
		{"aggregates apart", []windowRow{w(1, a, 1), w(2, b, 1), w(3, a, 2), w(4, b, 3)}, "[1 2 3]"},
		// Rows sharing a sequence exist only in a table written by hand:
		// one is taken, and the aggregate's rows end there.
		{"up to a shared sequence", []windowRow{w(1, a, 1), w(2, a, 2), w(3, a, 2), w(4, a, 3)}, "[1 2]"},
		{"a shared first sequence", []windowRow{w(1, a, 1), w(2, a, 1), w(3, a, 2)}, "[1]"},
		// The event before a#5 was the last this dispatcher delivered.
		{"behind an event it delivered", []windowRow{w(5, a, 5), w(6, a, 6)}, "[5 6]"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := &Dispatcher{accepted: acceptedSeqs{limit: 10}}
			d.accepted.add([]aggregateSeq{{a, 4}}, "")
			ids, err := d.pickOldest(context.Background(), nil, tc.window)
			if err != nil {
				t.Fatal(err)
			}
			if got := fmt.Sprint(ids); got != tc.want {
				t.Errorf("took %s, want %s", got, tc.want)
			}
		})
	}
}

func TestAcceptedSeqsForgetsEverythingWhenTheServerRestarts(t *testing.T) {
	a := aggregateKey{"agg", "a"}
	first, second := "1000.5 900.25", "1000.5 2000.75" // a recovery in place
	c := acceptedSeqs{limit: 10}
	c.serverStarted(first)
	c.add([]aggregateSeq{{a, 3}}, first)
	if !c.has(a, 3) {
		t.Fatal("forgot an event accepted on the same server")
	}
	c.serverStarted(second)
	if c.has(a, 3) {
		t.Error("remembers an event across a restart of the server")
	}
	c.add([]aggregateSeq{{a, 5}}, first) // leased before the restart, settled after
	if c.has(a, 5) {
		t.Error("recorded an event leased by the server before the restart")
	}
}
