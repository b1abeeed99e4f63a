package outbox_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// TestNewDispatcherRefusesASchemaThatIsNotCurrent makes a dispatcher on
// databases whose outbox schema is missing or older than the library's:
// NewDispatcher fails with ErrSchemaNotCurrent, naming outbox.AutoMigrate,
// instead of a dispatcher that fails every poll.
func TestNewDispatcherRefusesASchemaThatIsNotCurrent(t *testing.T) {
	migrate := func(t *testing.T, db *gorm.DB) { mustNil(t, outbox.AutoMigrate(db)) }
	cases := []struct {
		name string
		// prepare makes the schema and returns what the error must name
		// besides outbox.AutoMigrate; repair makes it current.
		prepare func(t *testing.T, e outboxtest.Engine, db *gorm.DB, info outboxtest.DB) string
		repair  func(t *testing.T, db *gorm.DB)
	}{
		{name: "no outbox tables",
			prepare: func(*testing.T, outboxtest.Engine, *gorm.DB, outboxtest.DB) string {
				return "outbox_records_migrations"
			},
			repair: migrate},
		{name: "a table made before versions were recorded",
			prepare: func(t *testing.T, e outboxtest.Engine, db *gorm.DB, _ outboxtest.DB) string {
				for _, stmt := range oldSchema(t, e) {
					mustNil(t, db.Exec(stmt).Error)
				}
				return "outbox_records_migrations"
			},
			repair: migrate},
		{name: "the newest version not recorded",
			prepare: func(t *testing.T, _ outboxtest.Engine, db *gorm.DB, _ outboxtest.DB) string {
				mustNil(t, outbox.AutoMigrate(db))
				var newest int
				mustNil(t, db.Raw(`SELECT max(version) FROM outbox_records_migrations`).Scan(&newest).Error)
				mustNil(t, db.Exec(`DELETE FROM outbox_records_migrations WHERE version = ?`, newest).Error)
				return fmt.Sprintf("lacks schema version(s) [%d]", newest)
			},
			// AutoMigrate would apply the version again over its own
			// columns: record it by hand, as migrate.go says.
			repair: func(t *testing.T, db *gorm.DB) {
				mustNil(t, db.Exec(`INSERT INTO outbox_records_migrations (version, name, applied_at)
					SELECT max(version) + 1, 'restored', 'now' FROM outbox_records_migrations`).Error)
			}},
		{name: "another table migrated",
			prepare: func(t *testing.T, _ outboxtest.Engine, _ *gorm.DB, info outboxtest.DB) string {
				other := outboxtest.Reopen(t, info, nil)
				mustNil(t, other.Use(outbox.Plugin(outbox.WithTable("other_outbox"))))
				mustNil(t, outbox.AutoMigrate(other))
				return "outbox_records_migrations"
			},
			repair: migrate},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
				db, info := outboxtest.Open(t, e, nil)
				mustNil(t, db.Use(outbox.Plugin()))
				want := tc.prepare(t, e, db, info)
				_, err := outbox.NewDispatcher(db, &recorder{})
				if !errors.Is(err, outbox.ErrSchemaNotCurrent) {
					t.Fatalf("NewDispatcher returned %v, want ErrSchemaNotCurrent", err)
				}
				for _, s := range []string{"outbox.AutoMigrate", want} {
					if !strings.Contains(err.Error(), s) {
						t.Fatalf("error %q does not name %q", err, s)
					}
				}
				tc.repair(t, db)
				if _, err := outbox.NewDispatcher(db, &recorder{}); err != nil {
					t.Fatalf("NewDispatcher once the schema is current: %v", err)
				}
			})
		})
	}
}

// TestNewDispatcherAcceptsANewerSchema makes a dispatcher on a schema
// migrated by a newer version of the library (a version it does not know
// is recorded): a rolling upgrade runs old and new dispatchers side by side.
func TestNewDispatcherAcceptsANewerSchema(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		mustNil(t, b.db.Exec(`INSERT INTO outbox_records_migrations (version, name, applied_at) VALUES (9999, 'from_the_future', '2030-01-01T00:00:00Z')`).Error)
		newDispatcher(t, b.db, &recorder{})
	})
}

// TestNewDispatcherOnADatabaseThatDoesNotAnswer makes a dispatcher on a
// closed pool: it fails with the database's error, which is not taken for
// a schema that is not current.
func TestNewDispatcherOnADatabaseThatDoesNotAnswer(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
		sqlDB, err := b.db.DB()
		mustNil(t, err)
		mustNil(t, sqlDB.Close())
		_, err = outbox.NewDispatcher(b.db, &recorder{})
		if err == nil || errors.Is(err, outbox.ErrSchemaNotCurrent) {
			t.Fatalf("NewDispatcher returned %v, want the database's error", err)
		}
	})
}
