package outbox

import "testing"

func TestAcceptedSeqsKnowsOnlyTheLastAcceptedEventOfAnAggregate(t *testing.T) {
	a, b := aggregateKey{"agg", "a"}, aggregateKey{"agg", "b"}
	c := acceptedSeqs{limit: 10}
	c.add([]aggregateSeq{{a, 1}, {a, 3}, {a, 2}})
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
	c.add([]aggregateSeq{{first, 1}, {aggregateKey{"agg", "second"}, 1}})
	if !c.has(first, 1) {
		t.Fatal("forgot an aggregate before it was full")
	}
	c.add([]aggregateSeq{{aggregateKey{"agg", "third"}, 1}, {aggregateKey{"agg", "fourth"}, 1}})
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
