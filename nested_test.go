package outbox_test

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// Writes inside writes: a Keeper has Pets, which have Toys, so that
// creating a keeper writes three levels deep, each level inside the
// savepoint of the one above in a caller's transaction.

type Keeper struct {
	ID   uint
	Name string
	Pets []Pet
}

func (k *Keeper) OutboxEvents(op outbox.Op) ([]outbox.Event, error) {
	return rowEvent("keeper", op, k.ID, map[string]any{"ID": k.ID, "Name": k.Name}), nil
}

type Pet struct {
	ID       uint
	KeeperID uint
	Name     string
	Toys     []Toy
}

func (p *Pet) OutboxEvents(op outbox.Op) ([]outbox.Event, error) {
	return rowEvent("pet", op, p.ID, map[string]any{"ID": p.ID, "KeeperID": p.KeeperID, "Name": p.Name}), nil
}

// Toy's emitter fails for a toy named "bad".
type Toy struct {
	ID    uint
	PetID uint
	Name  string
}

func (y *Toy) OutboxEvents(op outbox.Op) ([]outbox.Event, error) {
	if y.Name == "bad" {
		return nil, errEmitter
	}
	return rowEvent("toy", op, y.ID, y), nil
}

// Herald publishes an event of its own from its AfterCreate hook, on the
// transaction GORM hands the hook.
type Herald struct {
	ID   uint
	Name string
}

func (h *Herald) OutboxEvents(op outbox.Op) ([]outbox.Event, error) {
	return rowEvent("herald", op, h.ID, h), nil
}

func (h *Herald) AfterCreate(tx *gorm.DB) error {
	return outbox.Publish(tx, outbox.Event{Type: "herald.announced", AggregateType: "herald", AggregateID: strconv.Itoa(int(h.ID)), Payload: map[string]string{"Name": h.Name}})
}

// Member refers to members of its own table both ways: saving one saves
// its mentor first and its mentees after it, each inside its save.
type Member struct {
	ID       uint
	Name     string
	MentorID *uint
	Mentor   *Member
	Mentees  []Member `gorm:"foreignKey:MentorID"`
}

func (m *Member) OutboxEvents(op outbox.Op) ([]outbox.Event, error) {
	return rowEvent("member", op, m.ID, map[string]any{"ID": m.ID, "Name": m.Name, "MentorID": m.MentorID}), nil
}

func setupNested(t *testing.T, e outboxtest.Engine, cfg *gorm.Config) bundle {
	t.Helper()
	b := setup(t, e, cfg)
	mustNil(t, b.db.AutoMigrate(&Keeper{}, &Pet{}, &Toy{}, &Herald{}, &Member{}))
	return b
}

// TestWritesNestedInACallersTransactionRecordEveryRow: every write two or
// three levels deep (associations of associations, batches of them, a
// hook's Publish) inside db.Transaction records each row it wrote, on
// every engine.
func TestWritesNestedInACallersTransactionRecordEveryRow(t *testing.T) {
	cases := []struct {
		name string
		run  func(tx *gorm.DB) error
		want []string
	}{
		{"KeeperWithPetsWithToys", func(tx *gorm.DB) error {
			return tx.Create(&Keeper{Name: "k", Pets: []Pet{{Name: "p", Toys: []Toy{{Name: "ball"}, {Name: "bone"}}}}}).Error
		}, []string{
			`toy.create toy/1#1 {"ID":1,"Name":"ball","PetID":1}`,
			`toy.create toy/2#1 {"ID":2,"Name":"bone","PetID":1}`,
			`pet.create pet/1#1 {"ID":1,"KeeperID":1,"Name":"p"}`,
			`keeper.create keeper/1#1 {"ID":1,"Name":"k"}`,
		}},
		{"CreateInBatchesWithAssociations", func(tx *gorm.DB) error {
			return tx.CreateInBatches([]Keeper{
				{Name: "k1", Pets: []Pet{{Name: "p1"}}},
				{Name: "k2", Pets: []Pet{{Name: "p2", Toys: []Toy{{Name: "rope"}}}}},
			}, 1).Error
		}, []string{
			`pet.create pet/1#1 {"ID":1,"KeeperID":1,"Name":"p1"}`,
			`keeper.create keeper/1#1 {"ID":1,"Name":"k1"}`,
			`toy.create toy/1#1 {"ID":1,"Name":"rope","PetID":2}`,
			`pet.create pet/2#1 {"ID":2,"KeeperID":2,"Name":"p2"}`,
			`keeper.create keeper/2#1 {"ID":2,"Name":"k2"}`,
		}},
		{"PublishFromAModelsHook", func(tx *gorm.DB) error {
			return tx.Create(&Herald{Name: "h"}).Error
		}, []string{
			`herald.announced herald/1#1 {"Name":"h"}`,
			`herald.create herald/1#2 {"ID":1,"Name":"h"}`,
		}},
		{"SelfReferencingAssociations", func(tx *gorm.DB) error {
			return tx.Create(&Member{Name: "m", Mentor: &Member{Name: "boss"}, Mentees: []Member{{Name: "kid"}}}).Error
		}, []string{
			`member.create member/1#1 {"ID":1,"MentorID":null,"Name":"boss"}`,
			`member.create member/3#1 {"ID":3,"MentorID":2,"Name":"kid"}`,
			`member.create member/2#1 {"ID":2,"MentorID":1,"Name":"m"}`,
		}},
		{"NestedTransactionsOfTheCaller", func(tx *gorm.DB) error {
			return tx.Transaction(func(tx *gorm.DB) error {
				return tx.Create(&Keeper{Name: "k", Pets: []Pet{{Name: "p", Toys: []Toy{{Name: "ball"}}}}}).Error
			})
		}, []string{
			`toy.create toy/1#1 {"ID":1,"Name":"ball","PetID":1}`,
			`pet.create pet/1#1 {"ID":1,"KeeperID":1,"Name":"p"}`,
			`keeper.create keeper/1#1 {"ID":1,"Name":"k"}`,
		}},
	}
	for _, c := range cases {
		for _, v := range []struct {
			name string
			cfg  *gorm.Config
			tx   func(db *gorm.DB, fc func(tx *gorm.DB) error) error
		}{
			{"DBTransaction", nil, func(db *gorm.DB, fc func(tx *gorm.DB) error) error { return db.Transaction(fc) }},
			{"OutboxTransaction", nil, func(db *gorm.DB, fc func(tx *gorm.DB) error) error { return outbox.Transaction(db, fc) }},
			{"SkipDefaultTransaction", &gorm.Config{SkipDefaultTransaction: true}, func(db *gorm.DB, fc func(tx *gorm.DB) error) error { return db.Transaction(fc) }},
		} {
			t.Run(c.name+"/"+v.name, func(t *testing.T) {
				t.Parallel()
				outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
					b := setupNested(t, e, v.cfg)
					mustNil(t, v.tx(b.db, c.run))
					if got := styleEvents(t, b, 0); strings.Join(got, "\n") != strings.Join(c.want, "\n") {
						t.Fatalf("events:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(c.want, "\n"))
					}
				})
			})
		}
	}
}

// TestFailedNestedWriteLeavesNothingWhenTheCallerCommits: a toy's emitter
// fails three levels down; the caller ignores the error and commits. No
// keeper, pet or toy of that write remains, and no event: the failed
// write's savepoint took its parents' rows with it (SQLite, MySQL), or the
// transaction refuses to commit (PostgreSQL). What the transaction wrote
// before stays, with its events, where it commits.
func TestFailedNestedWriteLeavesNothingWhenTheCallerCommits(t *testing.T) {
	kept := `[kept] [kept] [] [pet.create pet/1#1 {"ID":1,"KeeperID":1,"Name":"kept"} keeper.create keeper/1#1 {"ID":1,"Name":"kept"}]`
	for name, c := range map[string]struct {
		write func(tx *gorm.DB) error
		want  string // keepers, pets, toys and events once the caller committed
	}{
		"Create": {func(tx *gorm.DB) error {
			return tx.Create(&Keeper{Name: "lost", Pets: []Pet{{Name: "lost", Toys: []Toy{{Name: "ok"}, {Name: "bad"}}}}}).Error
		}, kept},
		"CreateInBatches": {func(tx *gorm.DB) error {
			return tx.CreateInBatches([]Keeper{{Name: "lost", Pets: []Pet{{Name: "lost", Toys: []Toy{{Name: "ok"}}}}},
				{Name: "lost", Pets: []Pet{{Name: "lost", Toys: []Toy{{Name: "bad"}}}}}}, 1).Error
		}, kept},
		// The save of the keeper fails with its new toy: the keeper keeps
		// its name, and the re-saved pet and toy record nothing.
		"SaveReSavingChildren": {func(tx *gorm.DB) error {
			k := Keeper{Name: "saved", Pets: []Pet{{Name: "saved", Toys: []Toy{{Name: "ok"}}}}}
			if err := tx.Create(&k).Error; err != nil {
				return err
			}
			k.Name = "changed"
			k.Pets[0].Toys = append(k.Pets[0].Toys, Toy{Name: "bad"})
			return tx.Save(&k).Error
		}, `[kept saved] [kept saved] [ok] [pet.create pet/1#1 {"ID":1,"KeeperID":1,"Name":"kept"} keeper.create keeper/1#1 {"ID":1,"Name":"kept"} ` +
			`toy.create toy/1#1 {"ID":1,"Name":"ok","PetID":2} pet.create pet/2#1 {"ID":2,"KeeperID":2,"Name":"saved"} keeper.create keeper/2#1 {"ID":2,"Name":"saved"}]`},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
				b := setupNested(t, e, nil)
				var writeErr error
				txErr := b.db.Transaction(func(tx *gorm.DB) error {
					if err := tx.Create(&Keeper{Name: "kept", Pets: []Pet{{Name: "kept"}}}).Error; err != nil {
						return err
					}
					writeErr = c.write(tx)
					return nil // the caller ignores the error and commits
				})
				if !errors.Is(writeErr, errEmitter) {
					t.Fatalf("err = %v, want the emitter's", writeErr)
				}
				var keepers, pets, toys []string
				mustNil(t, b.db.Model(&Keeper{}).Order("id").Pluck("name", &keepers).Error)
				mustNil(t, b.db.Model(&Pet{}).Order("id").Pluck("name", &pets).Error)
				mustNil(t, b.db.Model(&Toy{}).Order("id").Pluck("name", &toys).Error)
				got := fmt.Sprint(keepers, pets, toys, styleEvents(t, b, 0))
				want := c.want
				if e == outboxtest.Postgres && txErr != nil {
					// The emitter's failure aborted the transaction (unless
					// a savepoint of the caller's, as CreateInBatches sets,
					// rolled back past it).
					want = `[] [] [] []`
				} else {
					mustNil(t, txErr)
				}
				if got != want {
					t.Fatalf("keepers, pets, toys and events after the commit:\n%s\nwant:\n%s", got, want)
				}
			})
		})
	}
}
