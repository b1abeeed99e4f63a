package outbox_test

import (
	"database/sql"
	"database/sql/driver"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"testing"

	"gorm.io/gorm"
	"gorm.io/gorm/clause"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// Memo has a nullable column of each kind of field: plain values, a
// pointer, a sql.Null type and a Scanner of its own.
type Memo struct {
	ID     uint
	Title  string
	Note   string
	Count  int
	Remark *string
	Tag    sql.NullString
	Level  Level `gorm:"type:integer"`
}

func (m *Memo) OutboxEvents(op outbox.Op) ([]outbox.Event, error) {
	return rowEvent("memo", op, m.ID, m), nil
}

// Level is a Scanner whose Scan(nil) gives a value that is not its zero
// value, so that a test can tell which of the two a NULL becomes.
type Level struct {
	N    int
	Null bool
}

func (l *Level) Scan(v any) error {
	switch v := v.(type) {
	case nil:
		*l = Level{Null: true}
	case int64:
		*l = Level{N: int(v)}
	case []byte:
		n, err := strconv.Atoi(string(v))
		*l = Level{N: n}
		return err
	default:
		return fmt.Errorf("Level: cannot scan %T", v)
	}
	return nil
}

func (l Level) Value() (driver.Value, error) {
	if l.Null {
		return nil, nil
	}
	return int64(l.N), nil
}

// TestStoredNullReachesTheEventAsAFreshReadGivesIt: where a write leaves
// NULL in a column, the model handed to the emitter holds what a fresh
// read of the row gives (a field's zero value, a nil pointer, an invalid
// sql.Null*), not what the caller's struct held; and every event's payload
// is the row as a fresh read gives it (as it was, for a delete).
func TestStoredNullReachesTheEventAsAFreshReadGivesIt(t *testing.T) {
	full := func() Memo {
		return Memo{Title: "t", Note: "note", Count: 3, Remark: ptr("remark"), Tag: sql.NullString{String: "tag", Valid: true}, Level: Level{N: 2}}
	}
	stale := func() *Memo { m := full(); m.ID = 1; return &m }
	// The rows a case starts from, written without events: one with every
	// nullable column NULL, or one with every column set.
	nullRow := func(t *testing.T, db *gorm.DB) {
		mustNil(t, outbox.WithoutEvents(db).Select("Title").Create(&Memo{Title: "t"}).Error)
	}
	fullRow := func(t *testing.T, db *gorm.DB) {
		m := full()
		mustNil(t, outbox.WithoutEvents(db).Create(&m).Error)
	}
	noRow := func(*testing.T, *gorm.DB) {}
	const nulls = `"Count":0,"ID":1,"Level":{"N":0,"Null":false},"Note":"","Remark":null,"Tag":{"String":"","Valid":false}`
	cases := []struct {
		name  string
		start func(t *testing.T, db *gorm.DB)
		write func(db *gorm.DB) error
		want  []string
	}{
		{"CreateWithOmit", noRow, func(db *gorm.DB) error {
			m := full()
			return db.Omit("Note", "Count", "Remark", "Tag", "Level").Create(&m).Error
		}, []string{`memo.create {` + nulls + `,"Title":"t"}`}},
		{"CreateWithSelect", noRow, func(db *gorm.DB) error {
			m := full()
			return db.Select("Title").Create(&m).Error
		}, []string{`memo.create {` + nulls + `,"Title":"t"}`}},
		{"UpdateColumnToNULL", fullRow, func(db *gorm.DB) error {
			return db.Model(stale()).UpdateColumn("note", gorm.Expr("NULL")).Error
		}, []string{`memo.update {"Count":3,"ID":1,"Level":{"N":2,"Null":false},"Note":"","Remark":"remark","Tag":{"String":"tag","Valid":true},"Title":"t"}`}},
		{"UpdatesToNULL", fullRow, func(db *gorm.DB) error {
			null := gorm.Expr("NULL")
			return db.Model(stale()).Updates(map[string]any{"note": null, "count": null, "remark": null, "tag": null, "level": null}).Error
		}, []string{`memo.update {` + nulls + `,"Title":"t"}`}},
		{"UpdateFromStaleStruct", nullRow, func(db *gorm.DB) error {
			return db.Model(stale()).Update("title", "t2").Error
		}, []string{`memo.update {` + nulls + `,"Title":"t2"}`}},
		{"UpsertFromStaleStruct", nullRow, func(db *gorm.DB) error {
			m := stale()
			m.Title = "t2"
			return db.Clauses(clause.OnConflict{Columns: []clause.Column{{Name: "id"}}, DoUpdates: clause.AssignmentColumns([]string{"title"})}).Create(m).Error
		}, []string{`memo.update {` + nulls + `,"Title":"t2"}`}},
		{"DeleteOfStaleStruct", nullRow, func(db *gorm.DB) error {
			return db.Delete(stale()).Error
		}, []string{`memo.delete {` + nulls + `,"Title":"t"}`}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
				b := setup(t, e, nil)
				mustNil(t, b.db.AutoMigrate(&Memo{}))
				// What a fresh read of each row gives.
				read := func() map[string]string {
					var ms []Memo
					mustNil(t, b.db.Order("id").Find(&ms).Error)
					rows := map[string]string{}
					for _, m := range ms {
						p, err := json.Marshal(m)
						mustNil(t, err)
						rows[strconv.Itoa(int(m.ID))] = string(p)
					}
					return rows
				}
				c.start(t, b.db)
				before := read()
				mustNil(t, c.write(b.db))
				after := read()
				var got []string
				for _, r := range b.records(t) {
					var v any
					mustNil(t, json.Unmarshal([]byte(r.Payload), &v))
					p, err := json.Marshal(v)
					mustNil(t, err)
					got = append(got, r.EventType+" "+string(p))
					if r.EventType == "memo.delete" {
						assertJSON(t, r.Payload, before[r.AggregateID])
					} else {
						assertJSON(t, r.Payload, after[r.AggregateID])
					}
				}
				if strings.Join(got, "\n") != strings.Join(c.want, "\n") {
					t.Fatalf("events:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(c.want, "\n"))
				}
			})
		})
	}
}
