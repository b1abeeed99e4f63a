package outboxprom_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
	"github.com/gorm-outbox/outbox/outboxprom"
)

var accept = outbox.PublisherFunc(func(context.Context, outbox.Batch) error { return nil })

// batchOf returns a batch of n messages of 10 event types.
func batchOf(n int) outbox.Batch {
	b := outbox.Batch{ID: "b"}
	for i := range n {
		b.Messages = append(b.Messages, outbox.Message{EventID: fmt.Sprint(i), EventType: fmt.Sprintf("type.%d", i%10), AggregateType: "a", AggregateID: fmt.Sprint(i)})
	}
	return b
}

// BenchmarkWrap is the cost of the wrapper alone on a batch of 100.
func BenchmarkWrap(b *testing.B) {
	m, err := outboxprom.New(prometheus.NewRegistry())
	if err != nil {
		b.Fatal(err)
	}
	batch := batchOf(100)
	for name, p := range map[string]outbox.Publisher{"bare": accept, "outboxprom": m.Wrap(accept)} {
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				_ = p.Publish(context.Background(), batch)
			}
		})
	}
}

// BenchmarkDispatch is DispatchOnce of 100 events (each with a stored
// traceparent) on SQLite, publishing
// through the wrapper on every other dispatch and straight otherwise (which
// goes first is random), so that both see the same dispatcher, table and
// machine; writing the events
// is not timed. It reports the median time of a dispatch of each and the
// wrapped one's overhead in percent.
func BenchmarkDispatch(b *testing.B) {
	m, err := outboxprom.New(prometheus.NewRegistry())
	if err != nil {
		b.Fatal(err)
	}
	benchmarkPaired(b, accept, m.Wrap(accept))
}

func benchmarkPaired(b *testing.B, bare, wrapped outbox.Publisher) {
	db, _ := outboxtest.Open(b, outboxtest.SQLite, nil)
	if err := db.Use(outbox.Plugin()); err != nil {
		b.Fatal(err)
	}
	if err := outbox.AutoMigrate(db); err != nil {
		b.Fatal(err)
	}
	pubs := []outbox.Publisher{bare, wrapped}
	current := 0
	d, err := outbox.NewDispatcher(db, outbox.PublisherFunc(func(ctx context.Context, batch outbox.Batch) error {
		return pubs[current].Publish(ctx, batch)
	}), outbox.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))))
	if err != nil {
		b.Fatal(err)
	}
	events := make([]outbox.Event, 100)
	for i := range events {
		events[i] = outbox.Event{
			Type: fmt.Sprintf("type.%d", i%10), AggregateType: "a", AggregateID: fmt.Sprint(i), Payload: map[string]int{"i": i},
			Headers: map[string]string{"traceparent": fmt.Sprintf("00-0af7651916cd43dd8448eb211c80319c-%016x-01", i+1)}, // as TraceHeaders stores it
		}
	}
	var spent [2][]time.Duration
	for b.Loop() {
		first := rand.IntN(2) // so that no periodic cost of the dispatcher falls on one side
		for turn := range pubs {
			current = (turn + first) % 2
			b.StopTimer()
			if err := outbox.Publish(db, events...); err != nil {
				b.Fatal(err)
			}
			b.StartTimer()
			start := time.Now()
			if n, err := d.DispatchOnce(context.Background()); err != nil || n != len(events) {
				b.Fatalf("DispatchOnce: %d, %v", n, err)
			}
			spent[current] = append(spent[current], time.Since(start))
		}
	}
	bareNs, wrappedNs := median(spent[0]), median(spent[1])
	b.ReportMetric(bareNs, "bare-ns/dispatch")
	b.ReportMetric(wrappedNs, "wrapped-ns/dispatch")
	b.ReportMetric(100*(wrappedNs-bareNs)/bareNs, "%overhead")
}

// median returns the median of ds in nanoseconds.
func median(ds []time.Duration) float64 {
	slices.Sort(ds)
	return float64(ds[len(ds)/2].Nanoseconds())
}
