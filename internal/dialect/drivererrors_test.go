package dialect_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/gorm-outbox/outbox/internal/dialect"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// The drivers' errors are recognised by their shape (drivererrors.go), as
// they are and wrapped in any way errors.As sees through: %w, several %w,
// errors.Join, nested.
func TestDriverErrorsAreRecognisedHoweverWrapped(t *testing.T) {
	wrappings := map[string]func(error) error{
		"as is":  func(err error) error { return err },
		"%w":     func(err error) error { return fmt.Errorf("write: %w", err) },
		"two %w": func(err error) error { return fmt.Errorf("write: %w (%w)", errors.New("other"), err) },
		"joined": func(err error) error { return errors.Join(errors.New("other"), err) },
		"%w of joined": func(err error) error {
			return fmt.Errorf("write: %w", errors.Join(errors.New("other"), fmt.Errorf("insert: %w", err)))
		},
	}
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		db, _ := outboxtest.Open(t, e, nil)
		d, err := dialect.For(db)
		if err != nil {
			t.Fatal(err)
		}
		// A value each engine refuses: a CHECK constraint on SQLite, a
		// data exception (class 22) on PostgreSQL, text longer than its
		// column on MySQL.
		refused := map[outboxtest.Engine]string{
			outboxtest.SQLite:   `INSERT INTO probe (n, s) VALUES (-1, 'x')`,
			outboxtest.Postgres: `INSERT INTO probe (n, s) VALUES (1 / 0, 'x')`,
			outboxtest.MySQL:    `INSERT INTO probe (n, s) VALUES (1, 'xx')`,
		}[e]
		if err := db.Exec(`CREATE TABLE probe (n integer PRIMARY KEY CHECK (n >= 0), s varchar(1))`).Error; err != nil {
			t.Fatal(err)
		}
		if err := db.Exec(`INSERT INTO probe (n, s) VALUES (1, 'x')`).Error; err != nil {
			t.Fatal(err)
		}
		rejected := db.Exec(refused).Error
		duplicate := db.Exec(`INSERT INTO probe (n, s) VALUES (1, 'y')`).Error
		if rejected == nil || duplicate == nil {
			t.Fatalf("the probes did not fail: %v, %v", rejected, duplicate)
		}
		for name, wrap := range wrappings {
			if !d.RejectsData(wrap(rejected)) {
				t.Errorf("RejectsData(%s %v) = false", name, rejected)
			}
			if d.RejectsData(wrap(duplicate)) {
				t.Errorf("RejectsData(%s %v) = true for a duplicate key", name, duplicate)
			}
			if e == outboxtest.MySQL {
				if got := dialect.DuplicateKey(wrap(duplicate)); got != "PRIMARY" {
					t.Errorf("duplicateKey(%s %v) = %q, want PRIMARY", name, duplicate, got)
				}
				if got := dialect.DuplicateKey(wrap(rejected)); got != "" {
					t.Errorf("duplicateKey(%s %v) = %q, want none", name, rejected, got)
				}
			}
		}
	})
}
