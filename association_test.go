package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"strconv"
	"strings"
	"testing"

	"gorm.io/gorm"
	"gorm.io/gorm/clause"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// Writer has two many-to-many associations: Topics, which emit, and
// Genres, which do not.
type Writer struct {
	ID     uint
	Name   string
	Topics []Topic `gorm:"many2many:writer_topics"`
	Genres []Genre `gorm:"many2many:writer_genres"`
}

type Topic struct {
	ID   uint
	Name string
}

func (tp *Topic) OutboxEvents(op outbox.Op) ([]outbox.Event, error) {
	return rowEvent("topic", op, tp.ID, tp), nil
}

type Genre struct {
	ID   uint
	Name string
}

// TopicCopy is a second emitting model on the topics table.
type TopicCopy struct {
	ID   uint
	Name string
}

func (TopicCopy) TableName() string { return "topics" }

func (tp *TopicCopy) OutboxEvents(op outbox.Op) ([]outbox.Event, error) {
	return rowEvent("topic_copy", op, tp.ID, tp), nil
}

// setupWriters makes writer 1 with topics 1 and 2 and genres 1 and 2,
// writer 2 with topic 3 and genre 3, and topic 4 and genre 4 of no
// writer, recording no events.
func setupWriters(t *testing.T, e outboxtest.Engine) bundle {
	t.Helper()
	b := setup(t, e, nil)
	mustNil(t, b.db.AutoMigrate(&Writer{}, &Topic{}, &Genre{}))
	mustNil(t, outbox.WithoutEvents(b.db).Create(&[]Writer{
		{Name: "w1", Topics: []Topic{{Name: "a"}, {Name: "b"}}, Genres: []Genre{{Name: "a"}, {Name: "b"}}},
		{Name: "w2", Topics: []Topic{{Name: "c"}}, Genres: []Genre{{Name: "c"}}},
	}).Error)
	mustNil(t, outbox.WithoutEvents(b.db).Create(&Topic{Name: "free"}).Error)
	mustNil(t, outbox.WithoutEvents(b.db).Create(&Genre{Name: "free"}).Error)
	if n := len(b.records(t)); n != 0 {
		t.Fatalf("%d events after the setup, want none", n)
	}
	return b
}

func rename(association string, conds ...clause.Expression) clause.Association {
	return clause.Association{Association: association, Type: clause.OpUpdate, Conditions: conds,
		Set: []clause.Assignment{{Column: clause.Column{Name: "name"}, Value: "renamed"}}}
}

// TestAssociationUpdateOfManyToManyRecordsAnUpdatePerRow: gorm.G's
// update of a many-to-many association's rows, which GORM runs without a
// model, records an update per row it wrote, with the row as stored.
// (GORM v1.31.2 updates the associated rows of every owner: its statement
// does not keep the chain's conditions on the owners.)
func TestAssociationUpdateOfManyToManyRecordsAnUpdatePerRow(t *testing.T) {
	ctx := context.Background()
	cases := []struct {
		name   string
		before func(db *gorm.DB) error
		update clause.Association
		want   []string
	}{
		{"AllOfTheOwners", nil, rename("Topics"), []string{
			`topic.update topic/1#1 {"ID":1,"Name":"renamed"}`,
			`topic.update topic/2#1 {"ID":2,"Name":"renamed"}`,
			`topic.update topic/3#1 {"ID":3,"Name":"renamed"}`,
		}},
		{"WithConditions", nil, rename("Topics", clause.Eq{Column: clause.Column{Name: "name"}, Value: "b"}), []string{
			`topic.update topic/2#1 {"ID":2,"Name":"renamed"}`,
		}},
		{"ModelGormHasParsedTwice", func(db *gorm.DB) error {
			// The migrator parses Topic again, under the table name given.
			return db.Table("topics").AutoMigrate(&Topic{})
		}, rename("Topics", clause.Eq{Column: clause.Column{Name: "name"}, Value: "b"}), []string{
			`topic.update topic/2#1 {"ID":2,"Name":"renamed"}`,
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
				b := setupWriters(t, e)
				if c.before != nil {
					mustNil(t, c.before(b.db))
				}
				_, err := gorm.G[Writer](b.db).Where("id = ?", 1).Set(c.update).Update(ctx)
				mustNil(t, err)
				got := styleEvents(t, b, 0)
				slices.Sort(got)
				if strings.Join(got, "\n") != strings.Join(c.want, "\n") {
					t.Fatalf("events:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(c.want, "\n"))
				}
				var topics []Topic
				mustNil(t, b.db.Order("id").Find(&topics).Error)
				renamed := 0
				for _, tp := range topics {
					if tp.Name == "renamed" {
						renamed++
					}
				}
				if renamed != len(c.want) {
					t.Fatalf("topics %+v: %d renamed, want %d", topics, renamed, len(c.want))
				}
				for _, r := range b.records(t) {
					id, _ := strconv.Atoi(r.AggregateID)
					p, err := json.Marshal(topics[id-1])
					mustNil(t, err)
					assertJSON(t, r.Payload, string(p))
				}
			})
		})
	}
}

// TestAssociationUpdateOfModelsThatDoNotEmitRecordsNothing: the same
// update of an association whose model emits nothing writes as without
// the plugin.
func TestAssociationUpdateOfModelsThatDoNotEmitRecordsNothing(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setupWriters(t, e)
		_, err := gorm.G[Writer](b.db).Where("id = ?", 1).Set(rename("Genres")).Update(context.Background())
		mustNil(t, err)
		var n int64
		mustNil(t, b.db.Model(&Genre{}).Where("name = ?", "renamed").Count(&n).Error)
		if n != 3 {
			t.Fatalf("%d genres renamed, want 3", n)
		}
		if got := styleEvents(t, b, 0); len(got) != 0 {
			t.Fatalf("events %v, want none", got)
		}
	})
}

// TestAssociationUpdateOfATableTwoEmittersShareIsRefused: when two
// emitting models have the associated table, the plugin cannot tell
// whose events the rows give, and refuses the update before it writes.
func TestAssociationUpdateOfATableTwoEmittersShareIsRefused(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setupWriters(t, e)
		var copies []TopicCopy
		mustNil(t, b.db.Find(&copies).Error) // GORM now knows both models
		_, err := gorm.G[Writer](b.db).Where("id = ?", 1).Set(rename("Topics")).Update(context.Background())
		if !errors.Is(err, outbox.ErrUnidentifiedRows) {
			t.Fatalf("update: %v, want ErrUnidentifiedRows", err)
		}
		var n int64
		mustNil(t, b.db.Model(&Topic{}).Where("name = ?", "renamed").Count(&n).Error)
		if n != 0 {
			t.Fatalf("%d topics renamed by a refused update", n)
		}
		if got := styleEvents(t, b, 0); len(got) != 0 {
			t.Fatalf("events %v, want none", got)
		}
	})
}

// TestWriteThroughTableWithoutAModelRecordsNothing: a write that names a
// table instead of a model is not seen by the plugin, even on the table
// of an emitting model (docs/writing.md says what to do instead).
func TestWriteThroughTableWithoutAModelRecordsNothing(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setupWriters(t, e)
		mustNil(t, b.db.Table("topics").Where("id = ?", 1).Updates(map[string]any{"name": "renamed"}).Error)
		mustNil(t, b.db.Table("topics").Where("id = ?", 4).Delete(nil).Error)
		var n int64
		mustNil(t, b.db.Model(&Topic{}).Where("name = ?", "renamed").Count(&n).Error)
		if n != 1 {
			t.Fatalf("%d topics renamed, want 1", n)
		}
		mustNil(t, b.db.Model(&Topic{}).Count(&n).Error)
		if n != 3 {
			t.Fatalf("%d topics, want 3", n)
		}
		if got := styleEvents(t, b, 0); len(got) != 0 {
			t.Fatalf("events %v, want none", got)
		}
	})
}

// Shelf's Books go with it: the database deletes them (ON DELETE CASCADE).
type Shelf struct {
	ID    uint
	Name  string
	Books []Book `gorm:"constraint:OnDelete:CASCADE"`
}

func (s *Shelf) OutboxEvents(op outbox.Op) ([]outbox.Event, error) {
	return rowEvent("shelf", op, s.ID, map[string]any{"ID": s.ID, "Name": s.Name}), nil
}

type Book struct {
	ID      uint
	ShelfID uint
	Title   string
}

func (bk *Book) OutboxEvents(op outbox.Op) ([]outbox.Event, error) {
	return rowEvent("book", op, bk.ID, bk), nil
}

// TestCascadeDeleteRecordsOnlyWhatGormDeletes: rows the database removes
// through ON DELETE CASCADE record nothing; deleting them through GORM
// first, with Select, records each one's delete.
func TestCascadeDeleteRecordsOnlyWhatGormDeletes(t *testing.T) {
	cases := []struct {
		name   string
		delete func(db *gorm.DB, s *Shelf) error
		want   []string
	}{
		{"ByTheDatabase", func(db *gorm.DB, s *Shelf) error { return db.Delete(s).Error }, []string{
			`shelf.delete shelf/1#1 {"ID":1,"Name":"s"}`,
		}},
		{"ThroughGormFirst", func(db *gorm.DB, s *Shelf) error { return db.Select("Books").Delete(s).Error }, []string{
			`book.delete book/1#1 {"ID":1,"ShelfID":1,"Title":"x"}`,
			`book.delete book/2#1 {"ID":2,"ShelfID":1,"Title":"y"}`,
			`shelf.delete shelf/1#1 {"ID":1,"Name":"s"}`,
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
				b := setup(t, e, nil)
				mustNil(t, b.db.AutoMigrate(&Shelf{}, &Book{}))
				s := Shelf{Name: "s", Books: []Book{{Title: "x"}, {Title: "y"}}}
				mustNil(t, outbox.WithoutEvents(b.db).Create(&s).Error)
				mustNil(t, c.delete(b.db, &s))
				var n int64
				mustNil(t, b.db.Model(&Book{}).Count(&n).Error)
				if n != 0 {
					t.Fatalf("%d books left, want none", n)
				}
				if got := styleEvents(t, b, 0); strings.Join(got, "\n") != strings.Join(c.want, "\n") {
					t.Fatalf("events:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(c.want, "\n"))
				}
			})
		})
	}
}

// QualifiedWriter and QualifiedTopic name their tables with the schema's
// name, which GORM's Table keeps apart from the table's.
type QualifiedWriter struct {
	ID     uint
	Name   string
	Topics []QualifiedTopic `gorm:"many2many:main.qualified_writer_topics"`
}

func (QualifiedWriter) TableName() string { return "main.qualified_writers" }

type QualifiedTopic struct {
	ID   uint
	Name string
}

func (QualifiedTopic) TableName() string { return "main.qualified_topics" }

func (tp *QualifiedTopic) OutboxEvents(op outbox.Op) ([]outbox.Event, error) {
	return rowEvent("topic", op, tp.ID, tp), nil
}

// TestAssociationUpdateOfTablesNamedWithTheirSchemaRecordsAnUpdatePerRow:
// tables named "schema.table" (SQLite's main here; GORM's SQLite migrator
// cannot create them, so they are made by hand).
func TestAssociationUpdateOfTablesNamedWithTheirSchemaRecordsAnUpdatePerRow(t *testing.T) {
	b := setup(t, outboxtest.SQLite, nil)
	for _, ddl := range []string{
		"CREATE TABLE qualified_writers (id integer PRIMARY KEY AUTOINCREMENT, name text)",
		"CREATE TABLE qualified_topics (id integer PRIMARY KEY AUTOINCREMENT, name text)",
		"CREATE TABLE qualified_writer_topics (qualified_writer_id integer, qualified_topic_id integer, PRIMARY KEY (qualified_writer_id, qualified_topic_id))",
	} {
		mustNil(t, b.db.Exec(ddl).Error)
	}
	mustNil(t, outbox.WithoutEvents(b.db).Create(&QualifiedWriter{Name: "w", Topics: []QualifiedTopic{{Name: "a"}, {Name: "b"}}}).Error)
	_, err := gorm.G[QualifiedWriter](b.db).Where("id = ?", 1).Set(rename("Topics")).Update(context.Background())
	mustNil(t, err)
	want := []string{
		`topic.update topic/1#1 {"ID":1,"Name":"renamed"}`,
		`topic.update topic/2#1 {"ID":2,"Name":"renamed"}`,
	}
	if got := styleEvents(t, b, 0); strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("events:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}
