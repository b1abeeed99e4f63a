package outbox_test

import (
	"slices"
	"strings"
	"testing"

	"gorm.io/gorm"
	"gorm.io/gorm/clause"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// Consignment has many Parcels and puts them in its own payload, as a
// service's aggregate often does.
type Consignment struct {
	ID      uint
	Note    string
	Parcels []Parcel
}

func (c *Consignment) OutboxEvents(op outbox.Op) ([]outbox.Event, error) {
	return rowEvent("consignment", op, c.ID, c), nil
}

type Parcel struct {
	ID            uint
	ConsignmentID uint
	Kg            int
}

func (p *Parcel) OutboxEvents(op outbox.Op) ([]outbox.Event, error) {
	return rowEvent("parcel", op, p.ID, p), nil
}

// TestLoadedAssociationsAreResavedAndRecordedAsTheCallerHoldsThem: a
// parent saved or updated with its associations loaded has GORM upsert
// each child again, which sets only the foreign key: each such re-save
// is recorded as an update of the child, with the values stored (on
// MySQL, where the server reports a row an upsert left as it was, only a
// re-save that changed the row: here none does). The
// parent's own event carries its associations as the caller holds them,
// which may be values the database never held. Omit(clause.Associations)
// leaves the children alone.
func TestLoadedAssociationsAreResavedAndRecordedAsTheCallerHoldsThem(t *testing.T) {
	cases := []struct {
		name  string
		write func(db *gorm.DB, c *Consignment) error
		want  []string
	}{
		{"Save", func(db *gorm.DB, c *Consignment) error {
			c.Note = "saved"
			return db.Save(c).Error
		}, []string{
			`parcel.update parcel/1#2 {"ConsignmentID":1,"ID":1,"Kg":5}`,
			`consignment.update consignment/1#2 {"ID":1,"Note":"saved","Parcels":[{"ConsignmentID":1,"ID":1,"Kg":50}]}`,
		}},
		{"Updates", func(db *gorm.DB, c *Consignment) error {
			return db.Model(c).Updates(Consignment{Note: "updated"}).Error
		}, []string{
			`parcel.update parcel/1#2 {"ConsignmentID":1,"ID":1,"Kg":5}`,
			`consignment.update consignment/1#2 {"ID":1,"Note":"updated","Parcels":[{"ConsignmentID":1,"ID":1,"Kg":50}]}`,
		}},
		{"UpdateOfOneColumn", func(db *gorm.DB, c *Consignment) error {
			return db.Model(c).Update("note", "one").Error
		}, []string{
			`parcel.update parcel/1#2 {"ConsignmentID":1,"ID":1,"Kg":5}`,
			`consignment.update consignment/1#2 {"ID":1,"Note":"one","Parcels":[{"ConsignmentID":1,"ID":1,"Kg":50}]}`,
		}},
		{"SaveOmittingAssociations", func(db *gorm.DB, c *Consignment) error {
			c.Note = "saved"
			return db.Omit(clause.Associations).Save(c).Error
		}, []string{
			`consignment.update consignment/1#2 {"ID":1,"Note":"saved","Parcels":[{"ConsignmentID":1,"ID":1,"Kg":50}]}`,
		}},
		{"UpdatesOmittingAssociations", func(db *gorm.DB, c *Consignment) error {
			return db.Model(c).Omit(clause.Associations).Updates(Consignment{Note: "updated"}).Error
		}, []string{
			`consignment.update consignment/1#2 {"ID":1,"Note":"updated","Parcels":[{"ConsignmentID":1,"ID":1,"Kg":50}]}`,
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
				b := setup(t, e, nil)
				mustNil(t, b.db.AutoMigrate(&Consignment{}, &Parcel{}))
				mustNil(t, b.db.Create(&Consignment{Note: "new", Parcels: []Parcel{{Kg: 5}}}).Error)
				n := len(b.records(t))

				var loaded Consignment
				mustNil(t, b.db.Preload("Parcels").First(&loaded).Error)
				loaded.Parcels[0].Kg = 50 // in memory only: GORM's upsert of a child sets its foreign key
				mustNil(t, c.write(b.db, &loaded))

				want := c.want
				if e == outboxtest.MySQL {
					want = slices.DeleteFunc(slices.Clone(want), func(ev string) bool { return strings.HasPrefix(ev, "parcel.update ") })
				}
				got := styleEvents(t, b, n)
				if strings.Join(got, "\n") != strings.Join(want, "\n") {
					t.Fatalf("events:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
				}
				var stored Parcel
				mustNil(t, b.db.First(&stored).Error)
				if stored.Kg != 5 {
					t.Fatalf("parcel holds %d kg, want 5: the re-save sets only the foreign key", stored.Kg)
				}
			})
		})
	}
}
