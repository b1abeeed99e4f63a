package outbox

import (
	"context"
	"testing"
	"time"

	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// A dead letter that RetryFailed brings back between parking's read and
// its write keeps the rows behind it due.
func TestParkLeavesTheRowsOfABlockerThatCameBackMeanwhile(t *testing.T) {
	for _, e := range []outboxtest.Engine{outboxtest.SQLite, outboxtest.Postgres} {
		t.Run(string(e), func(t *testing.T) {
			ctx := context.Background()
			db, _ := outboxtest.Open(t, e, nil)
			if err := db.Use(Plugin()); err != nil {
				t.Fatal(err)
			}
			if err := AutoMigrate(db); err != nil {
				t.Fatal(err)
			}
			for range 3 {
				if err := Publish(db, Event{Type: "t", AggregateType: "agg", AggregateID: "dead"}); err != nil {
					t.Fatal(err)
				}
			}
			if err := db.Exec(`UPDATE outbox_records SET delivery_state = 'failed', delivery_attempts = 1 WHERE aggregate_sequence = 1`).Error; err != nil {
				t.Fatal(err)
			}
			noop := PublisherFunc(func(context.Context, Batch) error { return nil })
			d, err := NewDispatcher(db, noop, WithLogger(outboxtest.Logger(t)), WithLease(time.Hour))
			if err != nil {
				t.Fatal(err)
			}
			blockers, err := d.blockers(ctx, time.Now())
			if err != nil || len(blockers) != 1 || blockers[0].sequence != 1 {
				t.Fatalf("blockers = %+v, %v; want the dead letter, sequence 1", blockers, err)
			}
			if n, err := d.RetryFailed(ctx); err != nil || n != 1 {
				t.Fatalf("RetryFailed = %d, %v; want 1", n, err)
			}
			if err := d.park(ctx, blockers, time.Now()); err != nil {
				t.Fatal(err)
			}
			for _, r := range outboxtest.Records(t, db, DefaultTable) {
				if r.NextAttemptAt.After(time.Now()) {
					t.Errorf("#%d parked until %v behind a dead letter that came back", r.AggregateSequence, r.NextAttemptAt)
				}
			}
		})
	}
}
