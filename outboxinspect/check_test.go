package outboxinspect_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
	"github.com/gorm-outbox/outbox/outboxinspect"
)

// dropUniqueKeys removes the unique constraints on the idempotency key and
// the event id, so that a test can plant duplicates.
func dropUniqueKeys(t *testing.T, db *gorm.DB, e outboxtest.Engine) {
	t.Helper()
	if e == outboxtest.Postgres {
		mustNil(t, db.Exec(`ALTER TABLE outbox_records DROP CONSTRAINT outbox_records_idempotency_key_key`).Error)
		mustNil(t, db.Exec(`ALTER TABLE outbox_records DROP CONSTRAINT outbox_records_event_id_key`).Error)
		return
	}
	for _, stmt := range []string{
		`CREATE TABLE outbox_copy AS SELECT * FROM outbox_records`,
		`DROP TABLE outbox_records`,
		`ALTER TABLE outbox_copy RENAME TO outbox_records`,
	} {
		mustNil(t, db.Exec(stmt).Error)
	}
}

func kinds(vs []outboxinspect.Violation) string {
	var ks []string
	for _, v := range vs {
		ks = append(ks, v.Kind)
	}
	return strings.Join(ks, ",")
}

func TestCheckFindsNothingOnADrainedTable(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		db := setup(t, e)
		publishN(t, db, "1", 3)
		publishN(t, db, "2", 2)
		d := newDispatcher(t, db, &recorder{})
		for dispatch(t, d) > 0 {
		}
		vs, err := outboxinspect.New(d).Check(context.Background(), outboxinspect.CheckOptions{})
		mustNil(t, err)
		if len(vs) != 0 {
			t.Fatalf("violations on a healthy table: %v", vs)
		}
	})
}

// Each case plants, by SQL, on three pending events of aggregate agg/1
// (sequences 1 to 3), what Check must report, or what it must allow.
func TestCheckFindsEachPlantedViolation(t *testing.T) {
	past := func(d time.Duration) time.Time { return time.Now().Add(-d) }
	for _, tc := range []struct {
		name  string
		plant func(t *testing.T, db *gorm.DB, e outboxtest.Engine)
		want  string // the kinds reported, in Check's order
		event string // the event id of the first violation, if any
	}{
		{"a sequence missing between rows", func(t *testing.T, db *gorm.DB, e outboxtest.Engine) {
			mustNil(t, db.Exec(`DELETE FROM outbox_records WHERE aggregate_sequence = 2`).Error)
		}, outboxinspect.ViolationSequenceGap, ""},
		{"sequences missing above the highest row", func(t *testing.T, db *gorm.DB, e outboxtest.Engine) {
			mustNil(t, db.Exec(`UPDATE outbox_records_sequences SET last_sequence = 5`).Error)
		}, outboxinspect.ViolationSequenceGap, ""},
		{"rows without a sequence row", func(t *testing.T, db *gorm.DB, e outboxtest.Engine) {
			mustNil(t, db.Exec(`DELETE FROM outbox_records_sequences`).Error)
		}, outboxinspect.ViolationSequenceGap, ""},
		{"cleaned-up sequences below the lowest row are allowed", func(t *testing.T, db *gorm.DB, e outboxtest.Engine) {
			mustNil(t, db.Exec(`DELETE FROM outbox_records WHERE aggregate_sequence < 3`).Error)
		}, "", ""},
		{"a discarded event between rows is allowed", func(t *testing.T, db *gorm.DB, e outboxtest.Engine) {
			mustNil(t, db.Exec(`UPDATE outbox_records SET delivery_state = 'failed' WHERE aggregate_sequence = 2`).Error)
			if n, err := newDispatcher(t, db, &recorder{}).Discard(context.Background(), outbox.RequeueFilter{}); n != 1 || err != nil {
				t.Fatalf("Discard = %d, %v; want 1", n, err)
			}
		}, "", ""},
		{"a discarded event below cleaned-up rows is allowed", func(t *testing.T, db *gorm.DB, e outboxtest.Engine) {
			mustNil(t, db.Exec(`UPDATE outbox_records SET delivery_state = 'failed' WHERE aggregate_sequence = 1`).Error)
			if n, err := newDispatcher(t, db, &recorder{}).Discard(context.Background(), outbox.RequeueFilter{}); n != 1 || err != nil {
				t.Fatalf("Discard = %d, %v; want 1", n, err)
			}
			mustNil(t, db.Exec(`DELETE FROM outbox_records WHERE aggregate_sequence = 2`).Error)
		}, "", ""},
		{"a discarded event deleted from its table leaves a gap", func(t *testing.T, db *gorm.DB, e outboxtest.Engine) {
			mustNil(t, db.Exec(`UPDATE outbox_records SET delivery_state = 'failed' WHERE aggregate_sequence = 2`).Error)
			if n, err := newDispatcher(t, db, &recorder{}).Discard(context.Background(), outbox.RequeueFilter{}); n != 1 || err != nil {
				t.Fatalf("Discard = %d, %v; want 1", n, err)
			}
			mustNil(t, db.Exec(`DELETE FROM outbox_records_discarded`).Error)
		}, outboxinspect.ViolationSequenceGap, ""},
		{"a delivered event after a pending one", func(t *testing.T, db *gorm.DB, e outboxtest.Engine) {
			mustNil(t, db.Exec(`UPDATE outbox_records SET delivery_state = 'delivered', delivered_at = ? WHERE aggregate_sequence = 3`,
				at(e, time.Now())).Error)
		}, outboxinspect.ViolationOrder, "agg-1-3"},
		{"a delivered event after a late settle's retry is allowed", func(t *testing.T, db *gorm.DB, e outboxtest.Engine) {
			mustNil(t, db.Exec(`UPDATE outbox_records SET delivery_state = 'retry', delivery_attempts = 1, next_attempt_at = ? WHERE aggregate_sequence = 1`,
				at(e, time.Now().Add(time.Minute))).Error)
			mustNil(t, db.Exec(`UPDATE outbox_records SET delivery_state = 'delivered', delivered_at = ? WHERE aggregate_sequence > 1`,
				at(e, time.Now())).Error)
		}, "", ""},
		{"a delivered event after one a publisher did not attempt is allowed", func(t *testing.T, db *gorm.DB, e outboxtest.Engine) {
			mustNil(t, db.Exec(`UPDATE outbox_records SET batch_id = 'b-1' WHERE aggregate_sequence = 1`).Error)
			mustNil(t, db.Exec(`UPDATE outbox_records SET delivery_state = 'delivered', delivered_at = ? WHERE aggregate_sequence > 1`,
				at(e, time.Now())).Error)
		}, "", ""},
		{"a lease that ended long ago", func(t *testing.T, db *gorm.DB, e outboxtest.Engine) {
			mustNil(t, db.Exec(`UPDATE outbox_records SET delivery_state = 'delivering', locked_until = ?, next_attempt_at = ? WHERE aggregate_sequence = 1`,
				at(e, past(2*time.Minute)), at(e, time.Now())).Error)
		}, outboxinspect.ViolationExpiredLease, "agg-1-1"},
		{"a lease that ended within the grace is allowed", func(t *testing.T, db *gorm.DB, e outboxtest.Engine) {
			mustNil(t, db.Exec(`UPDATE outbox_records SET delivery_state = 'delivering', locked_until = ? WHERE aggregate_sequence = 1`,
				at(e, past(10*time.Second))).Error)
		}, "", ""},
		{"an idempotency key and an event id twice", func(t *testing.T, db *gorm.DB, e outboxtest.Engine) {
			dropUniqueKeys(t, db, e)
			mustNil(t, db.Exec(`INSERT INTO outbox_records (id, event_id, event_type, aggregate_type, aggregate_id,
	aggregate_sequence, idempotency_key, payload, delivery_state, delivery_attempts, next_attempt_at, occurred_at, created_at, updated_at)
SELECT 100, event_id, event_type, aggregate_type, 'copy', 1, idempotency_key, payload, delivery_state,
	delivery_attempts, next_attempt_at, occurred_at, created_at, updated_at
FROM outbox_records WHERE aggregate_sequence = 1`).Error)
			mustNil(t, db.Exec(`INSERT INTO outbox_records_sequences (aggregate_type, aggregate_id, last_sequence) VALUES ('agg', 'copy', 1)`).Error)
		}, outboxinspect.ViolationDuplicateKey + "," + outboxinspect.ViolationDuplicateKey, ""},
		{"the oldest due event waited too long", func(t *testing.T, db *gorm.DB, e outboxtest.Engine) {
			mustNil(t, db.Exec(`UPDATE outbox_records SET next_attempt_at = ? WHERE aggregate_sequence = 1`,
				at(e, past(10*time.Minute))).Error)
		}, outboxinspect.ViolationDueAge, "agg-1-1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
				db := setup(t, e)
				for i := 1; i <= 3; i++ {
					mustNil(t, outbox.Publish(db, outbox.Event{ID: "agg-1-" + string(rune('0'+i)), Type: "t", AggregateType: "agg", AggregateID: "1"}))
				}
				tc.plant(t, db, e)
				vs, err := outboxinspect.New(newDispatcher(t, db, &recorder{})).Check(context.Background(), outboxinspect.CheckOptions{})
				mustNil(t, err)
				if got := kinds(vs); got != tc.want {
					t.Fatalf("violations %v, want kinds %q", vs, tc.want)
				}
				if tc.event != "" && vs[0].EventID != tc.event {
					t.Fatalf("violation %v, want it to name event %s", vs[0], tc.event)
				}
				for _, v := range vs {
					if v.Detail == "" || !strings.HasPrefix(v.String(), v.Kind) {
						t.Fatalf("violation without a readable detail: %#v", v)
					}
				}
			})
		})
	}
}

func TestCheckWithANegativeMaxDueAgeIgnoresLag(t *testing.T) {
	db := setup(t, outboxtest.SQLite)
	publishN(t, db, "1", 1)
	mustNil(t, db.Exec(`UPDATE outbox_records SET next_attempt_at = ?`, at(outboxtest.SQLite, time.Now().Add(-time.Hour))).Error)
	vs, err := outboxinspect.New(newDispatcher(t, db, &recorder{})).Check(context.Background(), outboxinspect.CheckOptions{MaxDueAge: -1})
	mustNil(t, err)
	if len(vs) != 0 {
		t.Fatalf("violations %v with the lag check off", vs)
	}
}
