package telemetry_test

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/telemetry"
)

func TestClassifyMirrorsTheDispatchersSettle(t *testing.T) {
	batch := outbox.Batch{ID: "b", Messages: []outbox.Message{
		{EventID: "a1", AggregateType: "o", AggregateID: "a", Sequence: 1},
		{EventID: "a2", AggregateType: "o", AggregateID: "a", Sequence: 2},
		{EventID: "b1", AggregateType: "o", AggregateID: "b", Sequence: 1},
	}}
	down := errors.New("down")
	A, R, P, N := telemetry.Accepted, telemetry.Retry, telemetry.Permanent, telemetry.NotAttempted
	cases := []struct {
		name string
		err  error
		want []telemetry.Outcome
	}{
		{"nil accepts all", nil, []telemetry.Outcome{A, A, A}},
		{"plain error retries all", down, []telemetry.Outcome{R, R, R}},
		{"permanent dead-letters all", fmt.Errorf("x: %w", outbox.Permanent(down)), []telemetry.Outcome{P, P, P}},
		{"not attempted puts all back", outbox.ErrNotAttempted, []telemetry.Outcome{N, N, N}},
		{"not attempted wins over permanent", outbox.Permanent(outbox.ErrNotAttempted), []telemetry.Outcome{N, N, N}},
		{"partial: per message", &outbox.PartialError{Failed: map[string]error{"a2": outbox.Permanent(down), "b1": down}}, []telemetry.Outcome{A, P, R}},
		{"partial: accepted after a failure of its aggregate", fmt.Errorf("w: %w", &outbox.PartialError{Failed: map[string]error{"a1": down}}), []telemetry.Outcome{R, N, A}},
		{"partial: nothing failed", &outbox.PartialError{}, []telemetry.Outcome{A, A, A}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := telemetry.Classify(batch, tc.err); !slices.Equal(got, tc.want) {
				t.Fatalf("Classify = %v, want %v", got, tc.want)
			}
		})
	}
}

func TestByTypeBoundsTheLabels(t *testing.T) {
	var mu sync.Mutex
	made := map[string]int{}
	b := telemetry.NewByType(2, func(label string) string {
		mu.Lock()
		defer mu.Unlock()
		made[label]++
		return label
	})
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for _, typ := range []string{"x", "y", "x", "y"} {
				if got := b.Get(typ); got != typ {
					t.Errorf("Get(%q) = %q", typ, got)
				}
			}
		})
	}
	wg.Wait()
	for _, typ := range []string{"z", "w"} {
		if got := b.Get(typ); got != telemetry.Other {
			t.Errorf("Get(%q) beyond the bound = %q, want %q", typ, got, telemetry.Other)
		}
	}
	if want := map[string]int{"x": 1, "y": 1, telemetry.Other: 1}; fmt.Sprint(made) != fmt.Sprint(want) {
		t.Fatalf("made %v, want each label once: %v", made, want)
	}
}

func TestOldestDueAgeIsZeroWhenNothingIsDue(t *testing.T) {
	now := time.Now()
	if a := telemetry.OldestDueAge(outbox.Stats{}, now); a != 0 {
		t.Fatalf("age %v, want 0", a)
	}
	if a := telemetry.OldestDueAge(outbox.Stats{OldestDue: now.Add(-1500 * time.Millisecond)}, now); a != 1.5 {
		t.Fatalf("age %v, want 1.5", a)
	}
}
