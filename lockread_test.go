package outbox_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"testing"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// TestUpdatesRecordExactlyTheRowsTheyWrote: each statement's events are
// one per row it changed, with the row as stored, and none for a row it
// did not. On MySQL a LIMIT writes some of the rows the condition matches
// (PostgreSQL and SQLite take no LIMIT in an UPDATE: GORM leaves it out,
// and they write every row), and an update may move a row to another
// primary key.
func TestUpdatesRecordExactlyTheRowsTheyWrote(t *testing.T) {
	cases := []struct {
		name  string
		write func(db *gorm.DB) error
	}{
		{"UpdateWithOrderAndLimit", func(db *gorm.DB) error {
			return db.Model(&Order{}).Where("status = ?", "new").Order("id desc").Limit(1).Update("status", "x").Error
		}},
		{"UpdateWithLimitAlone", func(db *gorm.DB) error {
			return db.Model(&Order{}).Where("total > ?", 0).Limit(2).Update("total", gorm.Expr("total * 10")).Error
		}},
		{"UpdatesWithLimitMatchingNothing", func(db *gorm.DB) error {
			return db.Model(&Order{}).Where("status = ?", "none").Limit(1).Updates(Order{Status: "x"}).Error
		}},
		{"SoftDeleteWithLimit", func(db *gorm.DB) error {
			return db.Where("status = ?", "new").Order("id").Limit(1).Delete(&SoftOrder{}).Error
		}},
		{"UpdateThatChangesThePrimaryKey", func(db *gorm.DB) error {
			return db.Model(&Order{ID: 2}).Update("id", 20).Error
		}},
		{"UpdatesThatSetThePrimaryKeyToItself", func(db *gorm.DB) error {
			return db.Model(&Order{}).Where("id = ?", 3).Updates(map[string]any{"id": 3, "status": "same key"}).Error
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
				b := setup(t, e, nil)
				mustNil(t, b.db.AutoMigrate(&SoftOrder{}))
				mustNil(t, outbox.WithoutEvents(b.db).Create(&[]Order{{Status: "new", Total: 1}, {Status: "new", Total: 2}, {Status: "new", Total: 3}}).Error)
				mustNil(t, outbox.WithoutEvents(b.db).Create(&[]SoftOrder{{Status: "new"}, {Status: "new"}, {Status: "new"}}).Error)
				before := tableRows(t, b.db)
				mustNil(t, c.write(b.db))
				assertEventsAreTheChangedRows(t, b, before, tableRows(t, b.db))
			})
		})
	}
}

// tableRows returns the orders and soft orders (deleted ones too), each
// as the payload of the event its write records, by aggregate.
func tableRows(t *testing.T, db *gorm.DB) map[string]string {
	t.Helper()
	rows := map[string]string{}
	var os []Order
	mustNil(t, db.Order("id").Find(&os).Error)
	for _, o := range os {
		p, err := json.Marshal(o)
		mustNil(t, err)
		rows["order/"+strconv.Itoa(int(o.ID))] = string(p)
	}
	var ss []SoftOrder
	mustNil(t, db.Unscoped().Order("id").Find(&ss).Error)
	for _, s := range ss {
		p, err := json.Marshal(map[string]any{"ID": s.ID, "Status": s.Status, "Deleted": s.DeletedAt.Valid})
		mustNil(t, err)
		rows["soft_order/"+strconv.Itoa(int(s.ID))] = string(p)
	}
	return rows
}

// assertEventsAreTheChangedRows checks that the outbox holds one event per
// row that changed between before and after, holding the row as it is
// after, and no other.
func assertEventsAreTheChangedRows(t *testing.T, b bundle, before, after map[string]string) {
	t.Helper()
	var changed []string
	for k, row := range after {
		if before[k] != row {
			changed = append(changed, k)
		}
	}
	var recorded []string
	for _, r := range b.records(t) {
		k := r.AggregateType + "/" + r.AggregateID
		recorded = append(recorded, k)
		if row, ok := after[k]; !ok {
			t.Errorf("event %s %s, but there is no such row", r.EventType, k)
		} else {
			assertJSON(t, r.Payload, row)
		}
	}
	slices.Sort(changed)
	slices.Sort(recorded)
	if fmt.Sprint(recorded) != fmt.Sprint(changed) {
		t.Fatalf("events for %v, want one for each row that changed: %v", recorded, changed)
	}
}

// TestUpdateThatSetsThePrimaryKeyToAnExpressionIsRefusedOnMySQL: there
// the plugin cannot know the key the update moves the row to, so the
// update is refused before it runs. PostgreSQL and SQLite return the row
// as stored.
func TestUpdateThatSetsThePrimaryKeyToAnExpressionIsRefusedOnMySQL(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		mustNil(t, b.db.AutoMigrate(&SoftOrder{}))
		mustNil(t, outbox.WithoutEvents(b.db).Create(&Order{Status: "new", Total: 1}).Error)
		before := tableRows(t, b.db)
		err := b.db.Model(&Order{ID: 1}).Update("id", gorm.Expr("id + 100")).Error
		if e == outboxtest.MySQL {
			if !errors.Is(err, outbox.ErrUnidentifiedRows) {
				t.Fatalf("err = %v, want ErrUnidentifiedRows", err)
			}
		} else {
			mustNil(t, err)
		}
		assertEventsAreTheChangedRows(t, b, before, tableRows(t, b.db))
	})
}
