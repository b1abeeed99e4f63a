package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"gorm.io/gorm"
	"gorm.io/gorm/clause"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

func TestCreateRecordsEventWithDefaults(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		before := time.Now()
		o := Order{Status: "new", Total: 42}
		if err := b.db.Create(&o).Error; err != nil {
			t.Fatal(err)
		}
		rs := b.records(t)
		if len(rs) != 1 {
			t.Fatalf("got %d outbox rows, want 1", len(rs))
		}
		r := rs[0]
		if r.EventType != "order.create" || r.AggregateType != "order" || r.AggregateID != fmt.Sprint(o.ID) {
			t.Errorf("row = %s %s/%s, want order.create order/%d", r.EventType, r.AggregateType, r.AggregateID, o.ID)
		}
		id, err := uuid.Parse(r.EventID)
		if err != nil || id.Version() != 7 {
			t.Errorf("event_id %q is not a UUIDv7 (%v)", r.EventID, err)
		}
		if r.IdempotencyKey != r.EventID {
			t.Errorf("idempotency_key = %q, want the event_id %q", r.IdempotencyKey, r.EventID)
		}
		if r.AggregateSequence != 1 || r.DeliveryState != "pending" || r.DeliveryAttempts != 0 {
			t.Errorf("sequence, state, attempts = %d, %s, %d; want 1, pending, 0", r.AggregateSequence, r.DeliveryState, r.DeliveryAttempts)
		}
		var got Order
		if err := json.Unmarshal([]byte(r.Payload), &got); err != nil || got != o {
			t.Errorf("payload %s decodes to %+v (%v), want %+v", r.Payload, got, err, o)
		}
		if r.OccurredAt.Before(before.Add(-time.Second)) || r.OccurredAt.After(time.Now().Add(time.Second)) {
			t.Errorf("occurred_at %v is not the time of the write", r.OccurredAt)
		}
		if r.NextAttemptAt.After(time.Now().Add(time.Second)) {
			t.Errorf("next_attempt_at %v is in the future: the event is not due at once", r.NextAttemptAt)
		}
		if r.Headers.Valid || r.BatchID.Valid || r.LockedUntil.Valid || r.DeliveredAt.Valid {
			t.Errorf("headers, batch_id, locked_until, delivered_at = %v, %v, %v, %v; want all NULL", r.Headers, r.BatchID, r.LockedUntil, r.DeliveredAt)
		}
	})
}

func TestNonEmittingModelRecordsNothing(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		w := Widget{Name: "w"}
		if err := b.db.Create(&w).Error; err != nil {
			t.Fatal(err)
		}
		if err := b.db.Model(&Widget{}).Where("name = ?", "w").Update("name", "v").Error; err != nil {
			t.Fatalf("a bulk update of a model without events must work: %v", err)
		}
		if n := len(b.records(t)); n != 0 {
			t.Fatalf("got %d outbox rows, want 0", n)
		}
	})
}

// TestOutboxRowsCommitIffBusinessWriteCommits checks atomicity in every kind
// of transaction, in both directions: a rolled-back business write leaves no
// event, and a failed event write leaves no business row.
func TestOutboxRowsCommitIffBusinessWriteCommits(t *testing.T) {
	cases := []struct {
		name string
		cfg  *gorm.Config
		// run writes and returns the orders that must exist afterwards; every
		// other order and its events must not.
		run func(t *testing.T, db *gorm.DB) []string
	}{
		{"ExplicitTransactionCommits", nil, func(t *testing.T, db *gorm.DB) []string {
			mustNil(t, db.Transaction(func(tx *gorm.DB) error { return tx.Create(&Order{Status: "a"}).Error }))
			return []string{"a"}
		}},
		{"ExplicitTransactionRollsBack", nil, func(t *testing.T, db *gorm.DB) []string {
			err := db.Transaction(func(tx *gorm.DB) error {
				if err := tx.Create(&Order{Status: "a"}).Error; err != nil {
					return err
				}
				return errors.New("abort")
			})
			mustErr(t, err)
			return nil
		}},
		{"SavepointRollsBack", nil, func(t *testing.T, db *gorm.DB) []string {
			mustNil(t, db.Transaction(func(tx *gorm.DB) error {
				if err := tx.Create(&Order{Status: "outer"}).Error; err != nil {
					return err
				}
				_ = tx.Transaction(func(tx2 *gorm.DB) error {
					if err := tx2.Create(&Order{Status: "inner"}).Error; err != nil {
						return err
					}
					return errors.New("roll back the savepoint")
				})
				return tx.Create(&Order{Status: "after"}).Error
			}))
			return []string{"outer", "after"}
		}},
		{"ManualSavepointRollsBack", nil, func(t *testing.T, db *gorm.DB) []string {
			tx := db.Begin()
			mustNil(t, tx.Create(&Order{Status: "kept"}).Error)
			mustNil(t, tx.SavePoint("sp").Error)
			mustNil(t, tx.Create(&Order{Status: "undone"}).Error)
			mustNil(t, tx.RollbackTo("sp").Error)
			mustNil(t, tx.Commit().Error)
			return []string{"kept"}
		}},
		{"DefaultTransactionFailsOnBadEvent", nil, func(t *testing.T, db *gorm.DB) []string {
			mustErr(t, db.Create(&Broken{Mode: "no-type"}).Error)
			return nil
		}},
		{"SkipDefaultTransactionFailsOnBadEvent", &gorm.Config{SkipDefaultTransaction: true}, func(t *testing.T, db *gorm.DB) []string {
			mustErr(t, db.Create(&Broken{Mode: "no-type"}).Error)
			return nil
		}},
		{"SkipDefaultTransactionSessionFailsOnBadEvent", nil, func(t *testing.T, db *gorm.DB) []string {
			s := db.Session(&gorm.Session{SkipDefaultTransaction: true})
			mustErr(t, s.Create(&Broken{Mode: "error"}).Error)
			return nil
		}},
		{"DefaultTransactionRollsBackOnPanickingEmitter", nil, func(t *testing.T, db *gorm.DB) []string {
			mustPanic(t, func() { db.Create(&Broken{Mode: "panic"}) })
			return nil
		}},
		{"SkipDefaultTransactionRollsBackOnPanickingEmitter", &gorm.Config{SkipDefaultTransaction: true}, func(t *testing.T, db *gorm.DB) []string {
			mustPanic(t, func() { db.Create(&Broken{Mode: "panic"}) })
			return nil
		}},
		{"SkipDefaultTransactionCommits", &gorm.Config{SkipDefaultTransaction: true}, func(t *testing.T, db *gorm.DB) []string {
			mustNil(t, db.Create(&Order{Status: "a"}).Error)
			mustNil(t, db.Create(&Broken{Mode: "ok"}).Error)
			return []string{"a", "broken"}
		}},
		{"SkipDefaultTransactionFailedInsertLeavesNoEvent", &gorm.Config{SkipDefaultTransaction: true}, func(t *testing.T, db *gorm.DB) []string {
			mustNil(t, db.Create(&Order{ID: 7, Status: "a"}).Error)
			mustErr(t, db.Create(&Order{ID: 7, Status: "dup"}).Error)
			return []string{"a"}
		}},
		{"SkipDefaultTransactionExplicitTransactionRollsBack", &gorm.Config{SkipDefaultTransaction: true}, func(t *testing.T, db *gorm.DB) []string {
			mustErr(t, db.Transaction(func(tx *gorm.DB) error {
				if err := tx.Create(&Order{Status: "a"}).Error; err != nil {
					return err
				}
				return errors.New("abort")
			}))
			return nil
		}},
		{"PreparedStatementsCommit", &gorm.Config{PrepareStmt: true}, func(t *testing.T, db *gorm.DB) []string {
			mustNil(t, db.Create(&Order{Status: "a"}).Error)
			mustNil(t, db.Transaction(func(tx *gorm.DB) error { return tx.Create(&Order{Status: "b"}).Error }))
			return []string{"a", "b"}
		}},
		{"PreparedStatementsRollBack", &gorm.Config{PrepareStmt: true, SkipDefaultTransaction: true}, func(t *testing.T, db *gorm.DB) []string {
			mustErr(t, db.Create(&Broken{Mode: "cycle"}).Error)
			mustErr(t, db.Transaction(func(tx *gorm.DB) error {
				if err := tx.Create(&Order{Status: "a"}).Error; err != nil {
					return err
				}
				return errRollback
			}))
			return nil
		}},
		{"PublishRollsBackWithTransaction", nil, func(t *testing.T, db *gorm.DB) []string {
			mustErr(t, db.Transaction(func(tx *gorm.DB) error {
				if err := outbox.Publish(tx, outbox.Event{Type: "x", AggregateType: "order", AggregateID: "1"}); err != nil {
					return err
				}
				return errors.New("abort")
			}))
			return nil
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
				b := setup(t, e, c.cfg)
				want := c.run(t, b.db)
				var statuses []string
				mustNil(t, b.db.Model(&Order{}).Order("id").Pluck("status", &statuses).Error)
				var broken int64
				mustNil(t, b.db.Model(&Broken{}).Count(&broken).Error)
				if broken > 0 {
					statuses = append(statuses, "broken")
				}
				if fmt.Sprint(statuses) != fmt.Sprint(want) {
					t.Fatalf("business rows %v, want %v", statuses, want)
				}
				// Every committed business row has its events, and no other
				// event exists.
				wantEvents := len(want)
				if broken > 0 {
					wantEvents++ // Broken "ok" writes two events
				}
				if n := len(b.records(t)); n != wantEvents {
					t.Fatalf("got %d outbox rows, want %d", n, wantEvents)
				}
			})
		})
	}
}

func TestEveryWritePathEmits(t *testing.T) {
	cases := []struct {
		name string
		// run writes starting from order 1 {Status: "new", Total: 1} and
		// returns the event types and statuses it expects, after the create.
		run  func(t *testing.T, db *gorm.DB, o *Order)
		want []string
	}{
		{"Save", func(t *testing.T, db *gorm.DB, o *Order) {
			o.Status = "saved"
			mustNil(t, db.Save(o).Error)
		}, []string{"order.update:saved"}},
		{"UpdatesStruct", func(t *testing.T, db *gorm.DB, o *Order) {
			mustNil(t, db.Model(o).Updates(Order{Status: "paid"}).Error)
		}, []string{"order.update:paid"}},
		{"UpdatesMap", func(t *testing.T, db *gorm.DB, o *Order) {
			mustNil(t, db.Model(o).Updates(map[string]any{"status": "shipped"}).Error)
		}, []string{"order.update:shipped"}},
		{"UpdateColumn", func(t *testing.T, db *gorm.DB, o *Order) {
			mustNil(t, db.Model(o).Update("status", "closed").Error)
		}, []string{"order.update:closed"}},
		{"Delete", func(t *testing.T, db *gorm.DB, o *Order) {
			mustNil(t, db.Delete(o).Error)
		}, []string{"order.delete:new"}},
		{"DeleteOfMissingRowEmitsNothing", func(t *testing.T, db *gorm.DB, o *Order) {
			mustNil(t, db.Delete(&Order{ID: 999}).Error)
		}, nil},
		{"CreateSlice", func(t *testing.T, db *gorm.DB, o *Order) {
			mustNil(t, db.Create([]*Order{{Status: "s1"}, {Status: "s2"}, {Status: "s3"}}).Error)
		}, []string{"order.create:s1", "order.create:s2", "order.create:s3"}},
		{"CreateInBatches", func(t *testing.T, db *gorm.DB, o *Order) {
			os := []Order{{Status: "b1"}, {Status: "b2"}, {Status: "b3"}, {Status: "b4"}, {Status: "b5"}}
			mustNil(t, db.CreateInBatches(os, 2).Error)
		}, []string{"order.create:b1", "order.create:b2", "order.create:b3", "order.create:b4", "order.create:b5"}},
		{"SaveSliceOfNew", func(t *testing.T, db *gorm.DB, o *Order) {
			mustNil(t, db.Save(&[]Order{{Status: "v1"}, {Status: "v2"}}).Error)
		}, []string{"order.create:v1", "order.create:v2"}},
		{"ValueReceiverEmitter", func(t *testing.T, db *gorm.DB, o *Order) {
			mustNil(t, db.Create(&Note{Text: "hi"}).Error)
		}, []string{"note.create:"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
				b := setup(t, e, nil)
				o := &Order{Status: "new", Total: 1}
				mustNil(t, b.db.Create(o).Error)
				c.run(t, b.db, o)
				var got []string
				for _, r := range b.records(t)[1:] {
					var p struct{ Status string }
					mustNil(t, json.Unmarshal([]byte(r.Payload), &p))
					got = append(got, r.EventType+":"+p.Status)
				}
				if fmt.Sprint(got) != fmt.Sprint(c.want) {
					t.Fatalf("events after the create: %v, want %v", got, c.want)
				}
			})
		})
	}
}

func TestWithoutEventsRunsWritesByConditionAndRecordsNothing(t *testing.T) {
	cases := []struct {
		name string
		run  func(db *gorm.DB) error
	}{
		{"UpdateWhere", func(db *gorm.DB) error {
			return db.Model(&Order{}).Where("status = ?", "new").Update("status", "x").Error
		}},
		{"UpdatesWhere", func(db *gorm.DB) error {
			return db.Model(&Order{}).Where("total > ?", 0).Updates(Order{Status: "x"}).Error
		}},
		{"DeleteWhere", func(db *gorm.DB) error {
			return db.Where("status = ?", "new").Delete(&Order{}).Error
		}},
		{"DeleteByInlineKey", func(db *gorm.DB) error {
			return db.Delete(&Order{}, 1).Error
		}},
		{"CreateFromMap", func(db *gorm.DB) error {
			return db.Model(&Order{}).Create(map[string]any{"status": "x"}).Error
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
				b := setup(t, e, nil)
				mustNil(t, outbox.WithoutEvents(b.db).Create(&Order{Status: "new", Total: 1}).Error)
				mustNil(t, c.run(outbox.WithoutEvents(b.db)))
				var n int64
				mustNil(t, b.db.Model(&Order{}).Where("status = ?", "new").Count(&n).Error)
				if n != 0 && c.name != "CreateFromMap" {
					t.Fatalf("the statement did not run: %d rows still new", n)
				}
				if n := len(b.records(t)); n != 0 {
					t.Fatalf("WithoutEvents recorded %d outbox rows, want none", n)
				}
			})
		})
	}
}

func TestGlobalWriteKeepsGormsMissingWhereClauseError(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		mustNil(t, b.db.Create(&[]Order{{Status: "a"}, {Status: "b"}}).Error)
		if err := b.db.Model(&Order{}).Update("status", "x").Error; !errors.Is(err, gorm.ErrMissingWhereClause) {
			t.Fatalf("global update: err = %v, want gorm.ErrMissingWhereClause", err)
		}
		if err := b.db.Delete(&Order{}).Error; !errors.Is(err, gorm.ErrMissingWhereClause) {
			t.Fatalf("global delete: err = %v, want gorm.ErrMissingWhereClause", err)
		}
		if n := len(b.records(t)); n != 2 {
			t.Fatalf("%d outbox rows after the refused writes, want the 2 creates", n)
		}
		// Allowed, a global write records an event for every row it wrote.
		all := b.db.Session(&gorm.Session{AllowGlobalUpdate: true})
		mustNil(t, all.Model(&Order{}).Update("status", "x").Error)
		mustNil(t, all.Delete(&Order{}).Error)
		got := styleEvents(t, b, 2)
		want := []string{
			`order.update order/1#2 {"ID":1,"Status":"x","Total":0}`,
			`order.update order/2#2 {"ID":2,"Status":"x","Total":0}`,
			`order.delete order/1#3 {"ID":1,"Status":"x","Total":0}`,
			`order.delete order/2#3 {"ID":2,"Status":"x","Total":0}`,
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("events %v, want %v", got, want)
		}
	})
}

// TestUpsertWithoutConflictColumnsIsRefusedOnSQLite: SQLite's RETURNING
// does not say whether an upsert inserted or updated a row, so the plugin
// reads the conflict keys first, and needs to be told them. PostgreSQL
// says in RETURNING which rows it inserted; on MySQL the conflict key is
// the primary key (the table's one unique key here).
func TestUpsertWithoutConflictColumnsIsRefusedOnSQLite(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		mustNil(t, b.db.Create(&Order{Status: "a"}).Error)
		up := clause.OnConflict{DoUpdates: clause.AssignmentColumns([]string{"status"})}
		if e == outboxtest.Postgres {
			up.OnConstraint = "orders_pkey"
		}
		err := b.db.Clauses(up).Create(&[]Order{{ID: 1, Status: "b"}, {ID: 2, Status: "c"}}).Error
		if e != outboxtest.SQLite {
			mustNil(t, err)
			got := styleEvents(t, b, 1)
			want := []string{`order.update order/1#2 {"ID":1,"Status":"b","Total":0}`, `order.create order/2#1 {"ID":2,"Status":"c","Total":0}`}
			if fmt.Sprint(got) != fmt.Sprint(want) {
				t.Fatalf("events %v, want %v", got, want)
			}
			return
		}
		if !errors.Is(err, outbox.ErrUnidentifiedRows) || !strings.Contains(err.Error(), "OnConflict{Columns") {
			t.Fatalf("err = %v, want ErrUnidentifiedRows naming the conflict columns", err)
		}
		var statuses []string
		mustNil(t, b.db.Model(&Order{}).Order("id").Pluck("status", &statuses).Error)
		if fmt.Sprint(statuses) != "[a]" || len(b.records(t)) != 1 {
			t.Fatalf("the refused upsert wrote: rows %v, %d outbox rows", statuses, len(b.records(t)))
		}
	})
}

// TestFailedPublishLeavesNothingWhenTheCallerCommits: the second event's
// event_id exists under another key, so its insert fails after the first
// event of the call was written.
func TestFailedPublishLeavesNothingWhenTheCallerCommits(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		mustNil(t, outbox.Publish(b.db, outbox.Event{ID: "e1", Type: "t", AggregateType: "order", AggregateID: "1"}))
		var publishErr error
		_ = b.db.Transaction(func(tx *gorm.DB) error {
			publishErr = outbox.Publish(tx,
				outbox.Event{Type: "t", AggregateType: "order", AggregateID: "1"},
				outbox.Event{ID: "e1", IdempotencyKey: "other", Type: "t", AggregateType: "order", AggregateID: "1"})
			return nil // the caller ignores the error and commits
		})
		if publishErr == nil {
			t.Fatal("Publish of an event_id that exists under another key succeeded")
		}
		if n := len(b.records(t)); n != 1 {
			t.Fatalf("%d outbox rows, want the first Publish's alone", n)
		}
		mustNil(t, outbox.Publish(b.db, outbox.Event{Type: "t", AggregateType: "order", AggregateID: "1"}))
		if rs := b.records(t); rs[len(rs)-1].AggregateSequence != 2 {
			t.Fatalf("the next event got sequence %d, want 2: the failed call left a gap", rs[len(rs)-1].AggregateSequence)
		}
	})
}

func TestFailedEmitterLeavesNoRowWhenTheCallerCommits(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		var createErr error
		_ = b.db.Transaction(func(tx *gorm.DB) error {
			createErr = tx.Create(&Broken{Mode: "error"}).Error
			return nil // the caller ignores the error and commits
		})
		if !errors.Is(createErr, errEmitter) {
			t.Fatalf("err = %v, want the emitter's", createErr)
		}
		var n int64
		mustNil(t, b.db.Model(&Broken{}).Count(&n).Error)
		if n != 0 || len(b.records(t)) != 0 {
			t.Fatalf("%d business rows and %d outbox rows committed, want none", n, len(b.records(t)))
		}
	})
}

func TestOverlongFieldsFailTheSameOnEveryEngine(t *testing.T) {
	long := strings.Repeat("x", 5000)
	cases := map[string]outbox.Event{
		"AggregateID":    {Type: "t", AggregateType: "order", AggregateID: long},
		"AggregateType":  {Type: "t", AggregateType: long, AggregateID: "1"},
		"Type":           {Type: long, AggregateType: "order", AggregateID: "1"},
		"IdempotencyKey": {Type: "t", AggregateType: "order", AggregateID: "1", IdempotencyKey: long},
		"ID":             {ID: long, Type: "t", AggregateType: "order", AggregateID: "1"},
	}
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		for field, ev := range cases {
			err := outbox.Publish(b.db, ev)
			if !errors.Is(err, outbox.ErrInvalidEvent) || !strings.Contains(err.Error(), field+" is 5000 characters long") {
				t.Errorf("%s: err = %v, want ErrInvalidEvent naming the field", field, err)
			}
			if err != nil && len(err.Error()) > 300 {
				t.Errorf("%s: the error is %d bytes long: it echoes the input", field, len(err.Error()))
			}
		}
		// At the limit, the event is stored.
		ev := outbox.Event{Type: strings.Repeat("t", outbox.MaxEventTypeLength), AggregateType: strings.Repeat("é", outbox.MaxAggregateTypeLength),
			AggregateID: strings.Repeat("漢", outbox.MaxAggregateIDLength), IdempotencyKey: strings.Repeat("k", outbox.MaxIdempotencyKeyLength)}
		mustNil(t, outbox.Publish(b.db, ev))
		if n := len(b.records(t)); n != 1 {
			t.Fatalf("%d outbox rows, want the event at the limits", n)
		}
	})
}

func TestInvalidEventFailsWriteAndWritesNothing(t *testing.T) {
	cases := []struct {
		mode string
		want error
		says string
	}{
		{"no-type", outbox.ErrInvalidEvent, "Type is empty"},
		{"no-aggregate-type", outbox.ErrInvalidEvent, "AggregateType is empty"},
		{"no-aggregate-id", outbox.ErrInvalidEvent, "AggregateID is empty"},
		{"channel", outbox.ErrInvalidEvent, "unsupported type"},
		{"function", outbox.ErrInvalidEvent, "unsupported type"},
		{"cycle", outbox.ErrInvalidEvent, "cycle"},
		{"raw-invalid", outbox.ErrInvalidEvent, "not valid JSON"},
		{"bytes-invalid", outbox.ErrInvalidEvent, "not valid JSON"},
		{"raw-empty", outbox.ErrInvalidEvent, "not valid JSON"},
		{"error", errEmitter, "OutboxEvents"},
	}
	for _, c := range cases {
		t.Run(c.mode, func(t *testing.T) {
			t.Parallel()
			outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
				b := setup(t, e, nil)
				err := b.db.Create(&Broken{Mode: c.mode}).Error
				if !errors.Is(err, c.want) || !strings.Contains(err.Error(), c.says) {
					t.Fatalf("err = %v, want %v saying %q", err, c.want, c.says)
				}
				var n int64
				mustNil(t, b.db.Model(&Broken{}).Count(&n).Error)
				if n != 0 || len(b.records(t)) != 0 {
					t.Fatalf("%d business rows and %d outbox rows written, want none", n, len(b.records(t)))
				}
				// The same bad event through Publish fails the same way.
				err = b.db.Transaction(func(tx *gorm.DB) error {
					evs, err := (&Broken{ID: 1, Mode: c.mode}).OutboxEvents(outbox.OpCreate)
					if err != nil {
						return err
					}
					return outbox.Publish(tx, evs...)
				})
				if !errors.Is(err, c.want) || len(b.records(t)) != 0 {
					t.Fatalf("Publish: err = %v and %d rows, want %v and none", err, len(b.records(t)), c.want)
				}
			})
		})
	}
}

func TestDuplicateIdempotencyKeyLeavesOneUnchangedRow(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		ev := outbox.Event{Type: "order.paid", AggregateType: "order", AggregateID: "1", IdempotencyKey: "pay-1", Payload: map[string]int{"v": 1}}
		mustNil(t, outbox.Publish(b.db, ev))
		// Same transaction twice, then another transaction.
		mustNil(t, b.db.Transaction(func(tx *gorm.DB) error {
			dup := ev
			dup.Payload = map[string]int{"v": 2}
			if err := outbox.Publish(tx, dup); err != nil {
				return err
			}
			return outbox.Publish(tx, dup)
		}))
		// Delivered rows are never reset to pending by a re-publish.
		mustNil(t, b.db.Exec(`UPDATE outbox_records SET delivery_state = 'delivered'`).Error)
		mustNil(t, outbox.Publish(b.db, ev))
		rs := b.records(t)
		if len(rs) != 1 {
			t.Fatalf("got %d rows for one idempotency key, want 1", len(rs))
		}
		if rs[0].DeliveryState != "delivered" || !strings.Contains(rs[0].Payload, `1`) {
			t.Fatalf("the existing row changed: state %s, payload %s", rs[0].DeliveryState, rs[0].Payload)
		}
		// Duplicates consume no sequence number.
		mustNil(t, outbox.Publish(b.db, outbox.Event{Type: "order.shipped", AggregateType: "order", AggregateID: "1"}))
		if rs := b.records(t); rs[1].AggregateSequence != 2 {
			t.Fatalf("the next event got sequence %d, want 2", rs[1].AggregateSequence)
		}
	})
}

func TestSequenceCountsPerAggregate(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		for _, agg := range []string{"a", "b", "a", "a", "b", "c"} {
			mustNil(t, outbox.Publish(b.db, outbox.Event{Type: "t", AggregateType: "order", AggregateID: agg}))
		}
		// The same id under another aggregate type is another aggregate.
		mustNil(t, outbox.Publish(b.db, outbox.Event{Type: "t", AggregateType: "invoice", AggregateID: "a"}))
		var got []string
		for _, r := range b.records(t) {
			got = append(got, fmt.Sprintf("%s/%s#%d", r.AggregateType, r.AggregateID, r.AggregateSequence))
		}
		want := "[order/a#1 order/b#1 order/a#2 order/a#3 order/b#2 order/c#1 invoice/a#1]"
		if fmt.Sprint(got) != want {
			t.Fatalf("sequences %v, want %v", got, want)
		}
	})
}

func TestPublishStoresExplicitFields(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		at := time.Date(2024, 5, 6, 7, 8, 9, 0, time.UTC)
		ev := outbox.Event{ID: "evt-1", Type: "order.note", AggregateType: "order", AggregateID: "9", IdempotencyKey: "k-1",
			Payload: json.RawMessage(`{"raw":true}`), Headers: map[string]string{"trace": "abc"}, OccurredAt: at}
		mustNil(t, outbox.Publish(b.db, ev, outbox.Event{Type: "bytes", AggregateType: "order", AggregateID: "9", Payload: []byte(`[1,2]`)}))
		rs := b.records(t)
		if len(rs) != 2 {
			t.Fatalf("got %d rows, want 2", len(rs))
		}
		r := rs[0]
		if r.EventID != "evt-1" || r.IdempotencyKey != "k-1" || !r.OccurredAt.Equal(at) {
			t.Errorf("event_id, idempotency_key, occurred_at = %q, %q, %v", r.EventID, r.IdempotencyKey, r.OccurredAt)
		}
		assertJSON(t, r.Payload, `{"raw":true}`)
		assertJSON(t, r.Headers.String, `{"trace":"abc"}`)
		assertJSON(t, rs[1].Payload, `[1,2]`)
	})
}

func TestPublishRequiresPlugin(t *testing.T) {
	db, _ := outboxtest.Open(t, outboxtest.SQLite, nil)
	err := outbox.Publish(db, outbox.Event{Type: "t", AggregateType: "a", AggregateID: "1"})
	if !errors.Is(err, outbox.ErrPluginNotRegistered) {
		t.Fatalf("err = %v, want ErrPluginNotRegistered", err)
	}
}

func TestRegisterEmitterGivesEventsToForeignType(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		mustNil(t, outbox.RegisterEmitter(b.plugin, func(f *Foreign, op outbox.Op) ([]outbox.Event, error) {
			return []outbox.Event{{Type: "foreign." + string(op), AggregateType: "foreign", AggregateID: fmt.Sprint(f.ID), Payload: f}}, nil
		}))
		f := Foreign{Name: "x"}
		mustNil(t, b.db.Create(&f).Error)
		mustNil(t, b.db.Model(&f).Update("name", "y").Error)
		rs := b.records(t)
		if len(rs) != 2 || rs[0].EventType != "foreign.create" || rs[1].EventType != "foreign.update" {
			t.Fatalf("rows %+v, want foreign.create then foreign.update", rs)
		}
		assertJSON(t, rs[1].Payload, `{"ID":1,"Name":"y"}`)
	})
}

func TestRegisterEmitterRejectsBadRegistrations(t *testing.T) {
	p := outbox.Plugin()
	fn := func(*Foreign, outbox.Op) ([]outbox.Event, error) { return nil, nil }
	mustNil(t, outbox.RegisterEmitter(p, fn))
	for name, err := range map[string]error{
		"Twice":           outbox.RegisterEmitter(p, fn),
		"Nil":             outbox.RegisterEmitter[Widget](p, nil),
		"NotStruct":       outbox.RegisterEmitter(p, func(*int, outbox.Op) ([]outbox.Event, error) { return nil, nil }),
		"AlreadyEmitter":  outbox.RegisterEmitter(p, func(*Order, outbox.Op) ([]outbox.Event, error) { return nil, nil }),
		"ValueReceiverEm": outbox.RegisterEmitter(p, func(*Note, outbox.Op) ([]outbox.Event, error) { return nil, nil }),
	} {
		if !errors.Is(err, outbox.ErrInvalidOption) {
			t.Errorf("%s: err = %v, want ErrInvalidOption", name, err)
		}
	}
}

func TestWithTableWritesToThatTable(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil, outbox.WithTable("Events_2"))
		mustNil(t, b.db.Create(&Order{Status: "a"}).Error)
		if n := outboxtest.Count(t, b.db, "Events_2"); n != 1 {
			t.Fatalf("Events_2 holds %d rows, want 1", n)
		}
		if n := outboxtest.Count(t, b.db, "Events_2_sequences"); n != 1 {
			t.Fatalf("Events_2_sequences holds %d rows, want 1", n)
		}
		if b.db.Migrator().HasTable(outbox.DefaultTable) {
			t.Fatalf("the default table was created too")
		}
	})
}

func TestWithTableRejectsNonIdentifiers(t *testing.T) {
	for _, name := range []string{"", "1abc", "a-b", "a b", `a"b`, "a;drop table x", "public.outbox", "é", strings.Repeat("a", 49)} {
		db, _ := outboxtest.Open(t, outboxtest.SQLite, nil)
		if err := db.Use(outbox.Plugin(outbox.WithTable(name))); !errors.Is(err, outbox.ErrInvalidOption) {
			t.Errorf("WithTable(%q): db.Use err = %v, want ErrInvalidOption", name, err)
		}
	}
}

func TestAutoMigrateIsIdempotent(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		mustNil(t, b.db.Create(&Order{Status: "a"}).Error)
		mustNil(t, outbox.AutoMigrate(b.db))
		if n := len(b.records(t)); n != 1 {
			t.Fatalf("a second AutoMigrate changed the data: %d rows", n)
		}
	})
}

func mustNil(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func mustErr(t *testing.T, err error) {
	t.Helper()
	if err == nil {
		t.Fatal("got no error, want one")
	}
}

func assertJSON(t *testing.T, got, want string) {
	t.Helper()
	var g, w any
	if err := json.Unmarshal([]byte(got), &g); err != nil {
		t.Fatalf("stored JSON %q does not decode: %v", got, err)
	}
	mustNil(t, json.Unmarshal([]byte(want), &w))
	if fmt.Sprint(g) != fmt.Sprint(w) {
		t.Fatalf("JSON %s, want %s", got, want)
	}
}

func mustPanic(t *testing.T, fn func()) {
	t.Helper()
	defer func() {
		if recover() == nil {
			t.Fatal("no panic")
		}
	}()
	fn()
}

// TestStatementsThroughOneDBEachGetTheirOwnEvents: GORM runs the
// statements of one chained *gorm.DB on a single Statement, whose instance
// settings outlive each of them; WithoutEvents on it must not silence the
// chain itself.
func TestStatementsThroughOneDBEachGetTheirOwnEvents(t *testing.T) {
	for name, cfg := range map[string]*gorm.Config{"DefaultTransaction": nil, "SkipDefaultTransaction": {SkipDefaultTransaction: true}} {
		t.Run(name, func(t *testing.T) { statementsThroughOneDB(t, cfg) })
	}
}

func statementsThroughOneDB(t *testing.T, cfg *gorm.Config) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, cfg)
		q := b.db.Model(&Order{})
		mustNil(t, q.Create(&Order{Status: "a"}).Error)
		mustNil(t, outbox.WithoutEvents(q).Create(&Order{Status: "quiet"}).Error)
		mustNil(t, q.Create(&Order{Status: "b"}).Error)
		var statuses []string
		mustNil(t, b.db.Model(&Order{}).Order("id").Pluck("status", &statuses).Error)
		if fmt.Sprint(statuses) != "[a quiet b]" {
			t.Fatalf("business rows %v, want [a quiet b]", statuses)
		}
		if n := len(b.records(t)); n != 2 {
			t.Fatalf("%d outbox rows, want 2 (a, b)", n)
		}
	})
}

// Audited writes a Note through WithoutEvents from its own AfterCreate hook.
type Audited struct {
	ID   uint
	Name string
}

func (a *Audited) OutboxEvents(op outbox.Op) ([]outbox.Event, error) {
	return []outbox.Event{{Type: "audited." + string(op), AggregateType: "audited", AggregateID: strconv.Itoa(int(a.ID))}}, nil
}

func (a *Audited) AfterCreate(tx *gorm.DB) error {
	return outbox.WithoutEvents(tx).Create(&Note{Text: "audit of " + a.Name}).Error
}

func TestWithoutEventsInAHookWritesWhatItIsGiven(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		mustNil(t, b.db.AutoMigrate(&Audited{}))
		mustNil(t, b.db.Create(&Audited{Name: "a"}).Error)
		var notes []string
		mustNil(t, b.db.Model(&Note{}).Pluck("text", &notes).Error)
		if fmt.Sprint(notes) != "[audit of a]" {
			t.Fatalf("notes %v, want [audit of a]", notes)
		}
		if recs := b.records(t); len(recs) != 1 || recs[0].EventType != "audited.create" {
			t.Fatalf("outbox rows %+v, want the audited.create event alone", recs)
		}
	})
}

// TestWithoutEventsCanBeKeptForSeveralStatements: the db WithoutEvents
// returns is a session: statement after statement run through it, each on
// a statement of its own, and record nothing, on every engine.
func TestWithoutEventsCanBeKeptForSeveralStatements(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		quiet := outbox.WithoutEvents(b.db)
		o := Order{Status: "new"}
		mustNil(t, quiet.Create(&o).Error)
		mustNil(t, quiet.Model(&o).Update("status", "paid").Error)
		mustNil(t, quiet.Create(&Order{Status: "second"}).Error)
		mustNil(t, quiet.Where("status = ?", "second").Delete(&Order{}).Error)
		var statuses []string
		mustNil(t, b.db.Model(&Order{}).Order("id").Pluck("status", &statuses).Error)
		if fmt.Sprint(statuses) != "[paid]" {
			t.Fatalf("orders %v, want [paid]", statuses)
		}
		if recs := b.records(t); len(recs) != 0 {
			t.Fatalf("%d outbox rows, want none", len(recs))
		}
	})
}

// TestWithoutEventsSilencesGormG: gorm.G[T](outbox.WithoutEvents(db))
// runs its statements on a new session of its own, with the call's
// context; they write and record nothing, on every engine.
func TestWithoutEventsSilencesGormG(t *testing.T) {
	ctx := context.Background()
	for _, c := range []struct {
		name string
		run  func(db *gorm.DB) error
		want string // the orders' statuses once it ran
	}{
		{"Create", func(db *gorm.DB) error {
			return gorm.G[Order](db).Create(ctx, &Order{Status: "made"})
		}, "[new made]"},
		{"CreateInBatches", func(db *gorm.DB) error {
			return gorm.G[Order](db).CreateInBatches(ctx, &[]Order{{Status: "a"}, {Status: "b"}, {Status: "c"}}, 2)
		}, "[new a b c]"},
		{"UpdateWhere", func(db *gorm.DB) error {
			_, err := gorm.G[Order](db).Where("status = ?", "new").Update(ctx, "status", "x")
			return err
		}, "[x]"},
		{"SetUpdate", func(db *gorm.DB) error {
			_, err := gorm.G[Order](db).Where("status = ?", "new").Set(clause.Assignment{Column: clause.Column{Name: "status"}, Value: "set"}).Update(ctx)
			return err
		}, "[set]"},
		{"DeleteWhere", func(db *gorm.DB) error {
			_, err := gorm.G[Order](db).Where("status = ?", "new").Delete(ctx)
			return err
		}, "[]"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
				b := setup(t, e, nil)
				mustNil(t, outbox.WithoutEvents(b.db).Create(&Order{Status: "new", Total: 1}).Error)
				mustNil(t, c.run(outbox.WithoutEvents(b.db)))
				var statuses []string
				mustNil(t, b.db.Model(&Order{}).Order("id").Pluck("status", &statuses).Error)
				if fmt.Sprint(statuses) != c.want {
					t.Fatalf("orders %v, want %s", statuses, c.want)
				}
				if n := len(b.records(t)); n != 0 {
					t.Fatalf("WithoutEvents recorded %d outbox rows, want none", n)
				}
				// The db WithoutEvents was given still records.
				mustNil(t, gorm.G[Order](b.db).Create(ctx, &Order{Status: "loud"}))
				if n := len(b.records(t)); n != 1 {
					t.Fatalf("%d outbox rows after a write through db itself, want 1", n)
				}
			})
		})
	}
}

// Clerk writes an Order from its AfterCreate hook, on the tx GORM hands
// the hook, and publishes an event of its own.
type Clerk struct {
	ID   uint
	Name string
}

func (c *Clerk) OutboxEvents(op outbox.Op) ([]outbox.Event, error) {
	return rowEvent("clerk", op, c.ID, c), nil
}

func (c *Clerk) AfterCreate(tx *gorm.DB) error {
	if err := tx.Create(&Order{Status: "by " + c.Name}).Error; err != nil {
		return err
	}
	return outbox.Publish(tx, outbox.Event{Type: "clerk.hired", AggregateType: "clerk", AggregateID: strconv.Itoa(int(c.ID))})
}

// TestWithoutEventsSilencesTheWritesOfHooks: a model's hook writes on a
// new session of the statement's; under WithoutEvents those writes record
// nothing either, while Publish records what it is given.
func TestWithoutEventsSilencesTheWritesOfHooks(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		mustNil(t, b.db.AutoMigrate(&Clerk{}))
		mustNil(t, outbox.WithoutEvents(b.db).Create(&Clerk{Name: "c"}).Error)
		var statuses []string
		mustNil(t, b.db.Model(&Order{}).Pluck("status", &statuses).Error)
		if fmt.Sprint(statuses) != "[by c]" {
			t.Fatalf("orders %v, want [by c]", statuses)
		}
		if got := styleEvents(t, b, 0); fmt.Sprint(got) != "[clerk.hired clerk/1#1 null]" {
			t.Fatalf("events %v, want the published clerk.hired alone", got)
		}
	})
}
