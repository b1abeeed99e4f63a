package outbox_test

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"

	"gorm.io/driver/mysql"
	"gorm.io/gorm"
	"gorm.io/gorm/clause"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// Ticket emits itself; its priority has a database default.
type Ticket struct {
	ID       uint
	Title    string
	Priority int `gorm:"default:3"`
}

func (tk *Ticket) OutboxEvents(op outbox.Op) ([]outbox.Event, error) {
	return []outbox.Event{{Type: "ticket." + string(op), AggregateType: "ticket", AggregateID: strconv.Itoa(int(tk.ID)), Payload: tk}}, nil
}

// setupMySQL8 is setup on the test's MariaDB server, opened as GORM opens
// MySQL 8, which has no RETURNING: the plugin then takes MySQL's paths.
func setupMySQL8(t *testing.T) bundle {
	t.Helper()
	_, info := outboxtest.Open(t, outboxtest.MySQL, nil)
	db, err := gorm.Open(mysql.New(mysql.Config{DSN: info.DSN, ServerVersion: "8.0.36", SkipInitializeWithVersion: true}), &gorm.Config{Logger: logger.Discard})
	mustNil(t, err)
	t.Cleanup(func() {
		if sqlDB, err := db.DB(); err == nil {
			sqlDB.Close()
		}
	})
	p := outbox.Plugin()
	mustNil(t, db.Use(p))
	mustNil(t, outbox.AutoMigrate(db))
	mustNil(t, db.AutoMigrate(&Order{}, &Ticket{}))
	return bundle{db: db, info: info, plugin: p}
}

func TestMySQL8CreatesReadTheirRowsBackByKey(t *testing.T) {
	for _, tc := range []struct {
		name   string
		create func(db *gorm.DB) (ids string, err error)
		want   []string
	}{
		{"AutoIncrementOne", func(db *gorm.DB) (string, error) {
			tk := Ticket{Title: "a"}
			err := db.Create(&tk).Error
			return fmt.Sprint(tk.ID), err
		}, []string{`ticket.create ticket/1#1 {"ID":1,"Priority":3,"Title":"a"}`}},
		{"AutoIncrementMany", func(db *gorm.DB) (string, error) {
			tks := []Ticket{{Title: "a"}, {Title: "b", Priority: 1}, {Title: "c"}}
			err := db.Create(&tks).Error
			return fmt.Sprint(tks[0].ID, tks[1].ID, tks[2].ID), err
		}, []string{
			`ticket.create ticket/1#1 {"ID":1,"Priority":3,"Title":"a"}`,
			`ticket.create ticket/2#1 {"ID":2,"Priority":1,"Title":"b"}`,
			`ticket.create ticket/3#1 {"ID":3,"Priority":3,"Title":"c"}`,
		}},
		{"KeysGivenOutOfOrder", func(db *gorm.DB) (string, error) {
			tks := []Ticket{{ID: 9, Title: "nine"}, {ID: 4, Title: "four"}}
			err := db.Create(&tks).Error
			return fmt.Sprint(tks[0].ID, tks[1].ID), err
		}, []string{
			`ticket.create ticket/9#1 {"ID":9,"Priority":3,"Title":"nine"}`,
			`ticket.create ticket/4#1 {"ID":4,"Priority":3,"Title":"four"}`,
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setupMySQL8(t)
			ids, err := tc.create(b.db)
			mustNil(t, err)
			got := styleEvents(t, b, 0)
			if strings.Join(got, "\n") != strings.Join(tc.want, "\n") {
				t.Fatalf("events:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(tc.want, "\n"))
			}
			var want []string
			for _, w := range tc.want {
				id, _, _ := strings.Cut(strings.TrimPrefix(strings.Fields(w)[1], "ticket/"), "#")
				want = append(want, id)
			}
			if ids != strings.Join(want, " ") {
				t.Errorf("the models hold keys %s, want %s", ids, strings.Join(want, " "))
			}
		})
	}
}

func TestMySQL8RefusesWhatItCannotReadBackAndWritesNothing(t *testing.T) {
	for name, write := range map[string]func(db *gorm.DB) error{
		"CreateFromMap": func(db *gorm.DB) error {
			return db.Model(&Ticket{}).Create(map[string]any{"Title": "m"}).Error
		},
		"SomeKeysGiven": func(db *gorm.DB) error {
			return db.Create(&[]Ticket{{ID: 5, Title: "five"}, {Title: "new"}}).Error
		},
		"Upsert": func(db *gorm.DB) error {
			return db.Clauses(clause.OnConflict{UpdateAll: true}).Create(&Ticket{ID: 1, Title: "up"}).Error
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setupMySQL8(t)
			if err := write(b.db); !errors.Is(err, outbox.ErrUnidentifiedRows) {
				t.Fatalf("err = %v, want ErrUnidentifiedRows", err)
			}
			var n int64
			mustNil(t, b.db.Model(&Ticket{}).Count(&n).Error)
			if n != 0 || len(b.records(t)) != 0 {
				t.Fatalf("the refused write left %d tickets and %d outbox rows", n, len(b.records(t)))
			}
		})
	}
}

func TestMySQL8DeletesReadTheirRowsFirst(t *testing.T) {
	b := setupMySQL8(t)
	mustNil(t, b.db.Create(&[]Ticket{{Title: "a"}, {Title: "b"}}).Error)
	mustNil(t, b.db.Where("title = ?", "b").Delete(&Ticket{}).Error)
	want := `ticket.delete ticket/2#2 {"ID":2,"Priority":3,"Title":"b"}`
	if got := styleEvents(t, b, 2); len(got) != 1 || got[0] != want {
		t.Fatalf("events %v, want [%s]", got, want)
	}
}

func TestMySQL8LimitedDeleteRecordsTheRowsItDeleted(t *testing.T) {
	b := setupMySQL8(t)
	mustNil(t, b.db.Create(&[]Ticket{{Title: "a"}, {Title: "a"}, {Title: "a"}}).Error)
	mustNil(t, b.db.Where("title = ?", "a").Order("id desc").Limit(2).Delete(&Ticket{}).Error)
	want := []string{ // in the statement's order
		`ticket.delete ticket/3#2 {"ID":3,"Priority":3,"Title":"a"}`,
		`ticket.delete ticket/2#2 {"ID":2,"Priority":3,"Title":"a"}`,
	}
	if got := styleEvents(t, b, 3); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("events %v, want %v", got, want)
	}
	var left []uint
	mustNil(t, b.db.Model(&Ticket{}).Pluck("id", &left).Error)
	if fmt.Sprint(left) != "[1]" {
		t.Fatalf("tickets left %v, want [1]", left)
	}
}
