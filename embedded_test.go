package outbox_test

import (
	"encoding/json"
	"testing"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// Stamp is embedded by Stamped through a pointer, which GORM reads its
// columns through.
type Stamp struct {
	By   string
	Memo *string
}

type Stamped struct {
	ID   uint
	Name string
	*Stamp
}

func (s *Stamped) OutboxEvents(op outbox.Op) ([]outbox.Event, error) {
	return rowEvent("stamped", op, s.ID, s), nil
}

// TestWritesLeaveTheStructsACallersModelEmbedsAsGORMDoes: the plugin
// fills copies of the caller's models with the rows as stored, and a
// struct the model embeds through a pointer is copied too: after a write,
// the caller's embedded struct holds what it held before (an edit not
// saved, the very pointer it set), as GORM alone leaves it, while the
// event holds the row as stored.
func TestWritesLeaveTheStructsACallersModelEmbedsAsGORMDoes(t *testing.T) {
	cases := []struct {
		name string
		// write writes s, the caller's model of a stored row whose By is
		// "me", holding an edit of By not saved.
		write func(db *gorm.DB, s *Stamped) error
		// stored is the By of the row the event holds.
		stored string
	}{
		{"Update", func(db *gorm.DB, s *Stamped) error { return db.Model(s).Update("name", "x").Error }, "me"},
		{"Updates", func(db *gorm.DB, s *Stamped) error { return db.Model(s).Updates(map[string]any{"name": "x"}).Error }, "me"},
		{"Delete", func(db *gorm.DB, s *Stamped) error { return db.Delete(s).Error }, "me"},
		{"CreateOmittingIt", func(db *gorm.DB, s *Stamped) error {
			s.ID = 0
			return db.Omit("By").Create(s).Error
		}, ""},
	}
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		mustNil(t, b.db.AutoMigrate(&Stamped{}))
		for _, c := range cases {
			t.Run(c.name, func(t *testing.T) {
				for _, db := range []*gorm.DB{outbox.WithoutEvents(b.db).Session(&gorm.Session{}), b.db} {
					memo := ptr("memo")
					s := Stamped{Name: "n", Stamp: &Stamp{By: "me", Memo: memo}}
					mustNil(t, db.Create(&s).Error)
					s.By = "unsaved"
					mustNil(t, c.write(db, &s))
					if s.By != "unsaved" || s.Memo != memo {
						t.Fatalf("the caller's embedded struct holds %+v after the write (without events: %t), want By %q and its own Memo pointer",
							*s.Stamp, db != b.db, "unsaved")
					}
				}
				records := b.records(t)
				var got Stamped
				mustNil(t, json.Unmarshal([]byte(records[len(records)-1].Payload), &got))
				if got.Stamp == nil || got.By != c.stored {
					t.Fatalf("the event holds %+v, want By %q, as stored", got.Stamp, c.stored)
				}
			})
		}
	})
}
