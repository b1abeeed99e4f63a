package outbox_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// TestLoadPostgres runs 8 writers and 4 dispatchers on PostgreSQL for 30
// seconds (3 seconds with -short, unless CI=true), each on a pool of its
// own. Every writer transaction creates an order (one event) and publishes
// an event on one of 50 shared accounts, so that writers contend on
// aggregates and dispatchers on rows. Afterwards every event must have been
// delivered, first acceptances in sequence order per aggregate, and the
// test reports event counts, throughput and the delivery lag from commit
// to publish.
func TestLoadPostgres(t *testing.T) {
	const writers, dispatchers, accounts = 8, 4, 50
	duration := 30 * time.Second
	if testing.Short() && os.Getenv("CI") != "true" {
		duration = 3 * time.Second
	}
	b := setup(t, outboxtest.Postgres, nil)
	pub := &lagRecorder{first: map[string]time.Time{}, next: map[string]int64{}}
	ctx, cancel := context.WithCancel(context.Background())
	var dwg sync.WaitGroup
	const poll = 100 * time.Millisecond
	for range dispatchers {
		db := outboxtest.Reopen(t, b.info, nil)
		mustNil(t, db.Use(outbox.Plugin()))
		d := newDispatcher(t, db, pub, outbox.WithPollInterval(poll))
		dwg.Add(1)
		go func() {
			defer dwg.Done()
			mustNilNow(t, d.Run(ctx))
		}()
	}
	defer func() {
		cancel()
		dwg.Wait()
	}()

	var (
		wg        sync.WaitGroup
		mu        sync.Mutex
		committed = map[string]time.Time{} // event key (see lagKey) -> when Commit returned
		txs       int
	)
	stop := time.Now().Add(duration)
	for w := range writers {
		db := outboxtest.Reopen(t, b.info, nil)
		mustNil(t, db.Use(outbox.Plugin()))
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; time.Now().Before(stop); i++ {
				key := fmt.Sprintf("w%d-%d", w, i)
				var o Order
				err := db.Transaction(func(tx *gorm.DB) error {
					o = Order{Status: key, Total: i}
					if err := tx.Create(&o).Error; err != nil {
						return err
					}
					return outbox.Publish(tx, outbox.Event{ID: "p-" + key, Type: "account.charged", AggregateType: "account",
						AggregateID: fmt.Sprint(rand.IntN(accounts)), Payload: map[string]any{"order": o.ID, "amount": i}})
				})
				at := time.Now()
				if err != nil {
					t.Errorf("writer %d: %v", w, err)
					return
				}
				mu.Lock()
				committed["p-"+key] = at
				committed[fmt.Sprintf("order/%d#1", o.ID)] = at
				txs++
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	written := time.Since(stop.Add(-duration))
	drainStart := time.Now()
	waitAllDelivered(t, b.db, 60*time.Second)
	drain := time.Since(drainStart)

	pub.mu.Lock()
	defer pub.mu.Unlock()
	if pub.outOfOrder > 0 {
		t.Errorf("%d first acceptances out of sequence order", pub.outOfOrder)
	}
	n := outboxtest.Count(t, b.db, outbox.DefaultTable)
	if int(n) != len(committed) || len(pub.first) != len(committed) {
		t.Errorf("%d events committed, %d in the table, %d delivered", len(committed), n, len(pub.first))
	}
	var lags []time.Duration
	for key, at := range committed {
		pubAt, ok := pub.first[key]
		if !ok {
			t.Errorf("event %s was never delivered", key)
			continue
		}
		lags = append(lags, max(0, pubAt.Sub(at)))
	}
	slices.Sort(lags)
	if len(lags) == 0 {
		t.Fatal("nothing was delivered")
	}
	pct := func(p float64) time.Duration { return lags[int(p*float64(len(lags)-1))].Round(time.Millisecond) }
	redeliveries := pub.acceptances - len(pub.first)
	if redeliveries != 0 {
		t.Errorf("%d redeliveries without any fault", redeliveries)
	}
	summary(t, "load (Postgres, %d writers, %d dispatchers, %v, race detector %v): %d transactions committed, %d events written (%.0f/s), %d delivered (%d acceptances, %d redeliveries), drained %v after the writers stopped; commit-to-publish lag median %v, p99 %v, worst %v (poll interval %v)",
		writers, dispatchers, duration, raceEnabled, txs, len(committed), float64(len(committed))/written.Seconds(), len(pub.first), pub.acceptances, redeliveries,
		drain.Round(100*time.Millisecond), pct(0.5), pct(0.99), lags[len(lags)-1].Round(time.Millisecond), poll)
	if worst := lags[len(lags)-1]; worst > 15*time.Second {
		t.Errorf("worst delivery lag %v, want under 15s", worst)
	}
}

// lagRecorder is a publisher that remembers when it first accepted each
// event, keyed by lagKey, and checks per-aggregate order.
type lagRecorder struct {
	mu          sync.Mutex
	first       map[string]time.Time
	next        map[string]int64
	acceptances int
	outOfOrder  int
}

// lagKey names an event the way the load test's writers know it: its ID
// for published events, aggregate and sequence for an order's creation.
func lagKey(m outbox.Message) string {
	if m.AggregateType == "order" {
		return fmt.Sprintf("order/%s#%d", m.AggregateID, m.Sequence)
	}
	return m.EventID
}

func (r *lagRecorder) Publish(_ context.Context, b outbox.Batch) error {
	now := time.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, m := range b.Messages {
		r.acceptances++
		key := lagKey(m)
		if _, seen := r.first[key]; seen {
			continue
		}
		r.first[key] = now
		agg := m.AggregateType + "/" + m.AggregateID
		if m.Sequence != r.next[agg]+1 {
			r.outOfOrder++
		}
		r.next[agg] = m.Sequence
	}
	return nil
}
