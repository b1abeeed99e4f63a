package outbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"gorm.io/driver/sqlite"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// SQLite keeps timestamps as text, so the outbox writes them in one
// fixed-width UTC form in which text order is time order. Times from other
// zones and with any fraction of a second must still compare right.
func TestSQLiteTimestampsCompareAsTimes(t *testing.T) {
	b := setup(t, outboxtest.SQLite, nil)
	zone := time.FixedZone("UTC+5", 5*3600)
	at := time.Date(2024, 1, 1, 10, 0, 0, 5, zone) // 05:00:00.000000005 UTC
	mustNil(t, outbox.Publish(b.db, outbox.Event{Type: "t", AggregateType: "a", AggregateID: "1", OccurredAt: at}))
	var raw []string
	mustNil(t, b.db.Raw(`SELECT occurred_at || '' FROM outbox_records`).Scan(&raw).Error)
	if len(raw) != 1 || raw[0] != "2024-01-01 05:00:00.000000005+00:00" {
		t.Fatalf("stored occurred_at %q, want the fixed-width UTC form", raw)
	}
	if r := b.records(t)[0]; !r.OccurredAt.Equal(at) {
		t.Fatalf("occurred_at reads back as %v, want %v", r.OccurredAt, at)
	}
	// A retry due in a second is not due now, and is due a second later:
	// the comparison of stored text against the claim's now is a time
	// comparison.
	fail := true
	rec := &recorder{Next: func(outbox.Batch) error {
		if fail {
			return errRollback
		}
		return nil
	}}
	second := outbox.RetryPolicyFunc(func(int, error) time.Duration { return time.Second })
	d := newDispatcher(t, b.db, rec, outbox.WithRetryPolicy(second))
	dispatch(t, d)
	fail = false
	if n := dispatch(t, d); n != 0 {
		t.Fatalf("a retry due in a second was dispatched at once")
	}
	time.Sleep(1100 * time.Millisecond)
	if n := dispatch(t, d); n != 1 {
		t.Fatalf("a retry due a second ago was not dispatched")
	}
}

// The CHECK constraints keep the JSON columns valid even for rows written
// around the library.
func TestSQLiteRejectsInvalidJSONWrittenAroundTheLibrary(t *testing.T) {
	b := setup(t, outboxtest.SQLite, nil)
	err := b.db.Exec(`INSERT INTO outbox_records (event_id, event_type, aggregate_type, aggregate_id, aggregate_sequence,
		idempotency_key, payload, next_attempt_at, occurred_at, created_at, updated_at)
		VALUES ('e', 't', 'a', '1', 1, 'k', '{not json', '2024-01-01', '2024-01-01', '2024-01-01', '2024-01-01')`).Error
	if err == nil || !strings.Contains(err.Error(), "CHECK") {
		t.Fatalf("err = %v, want a CHECK constraint failure", err)
	}
}

// Dispatchers on one SQLite file through separate pools (as separate
// processes would have) never publish one row twice while its lease lives.
func TestSQLiteDispatchersOnSeparatePoolsShareTheFile(t *testing.T) {
	b := setup(t, outboxtest.SQLite, nil)
	publishN(t, b.db, "a", 50)
	publishN(t, b.db, "b", 50)
	rec := &recorder{}
	done := make(chan error, 3)
	deadline := time.Now().Add(30 * time.Second)
	for range 3 {
		db := outboxtest.Reopen(t, b.info, nil)
		d := newDispatcher(t, db, rec, outbox.WithBatchSize(7), outbox.WithPollInterval(time.Millisecond))
		go func() {
			for time.Now().Before(deadline) {
				if _, err := d.DispatchOnce(context.Background()); err != nil {
					done <- err
					return
				}
				s, err := d.Stats(context.Background())
				if err != nil || s.Undelivered() == 0 {
					done <- err
					return
				}
			}
			done <- nil
		}()
	}
	for range 3 {
		mustNil(t, <-done)
	}
	seen := map[string]bool{}
	for _, m := range rec.Accepted() {
		if seen[m.EventID] {
			t.Fatalf("event %s published twice", m.EventID)
		}
		seen[m.EventID] = true
	}
	if len(seen) != 100 {
		t.Fatalf("%d of 100 events published", len(seen))
	}
}

// A dispatcher on SQLite takes a connection of its own for each claim, so
// it refuses at construction a pool with no *sql.DB behind it, rather than
// failing every claim.
func TestSQLiteDispatcherRefusesAPoolWithoutASQLDB(t *testing.T) {
	b := setup(t, outboxtest.SQLite, nil)
	sqlDB, err := b.db.DB()
	mustNil(t, err)
	db, err := gorm.Open(sqlite.Dialector{Conn: beginningPool{sqlDB}}, &gorm.Config{Logger: logger.Discard})
	mustNil(t, err)
	_, err = outbox.NewDispatcher(db, &recorder{})
	if !errors.Is(err, outbox.ErrInvalidOption) || !strings.Contains(err.Error(), "no *sql.DB") {
		t.Fatalf("NewDispatcher = %v, want ErrInvalidOption saying there is no *sql.DB", err)
	}
}
