package outbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox/internal/dialect"
)

// ErrSchemaNotCurrent is returned (wrapped) by [NewDispatcher] when the
// database has no outbox tables, or its tables lack a schema version this
// library needs (they were made by an older version of it): run
// [AutoMigrate], or apply [Migrations] with your own tool, first. The
// message names the versions missing. A schema newer than the library's
// (migrated by a newer version of it) is accepted.
var ErrSchemaNotCurrent = errors.New("outbox: the outbox schema is not current")

// schemaCheckTimeout bounds NewDispatcher's read of the schema versions.
const schemaCheckTimeout = 10 * time.Second

// schemaCurrent returns an error wrapping ErrSchemaNotCurrent unless the
// version table of t (<table>_migrations, as AutoMigrate keeps it) lists
// every migration of d. It costs one query, two when the version table
// cannot be read: the second, SELECT 1, tells a missing table from a
// database that does not answer, whose error it returns as it is.
func schemaCurrent(ctx context.Context, db *gorm.DB, d dialect.Dialect, t dialect.Tables) error {
	ms, err := migrationsFor(d.Name())
	if err != nil {
		return err
	}
	pool := db.Statement.ConnPool
	versions := t.Name + "_migrations"
	rows, err := pool.QueryContext(ctx, `SELECT version FROM `+t.Quote(versions))
	if err != nil {
		var one int
		if pingErr := pool.QueryRowContext(ctx, `SELECT 1`).Scan(&one); pingErr != nil {
			return fmt.Errorf("outbox: read the schema version of %s: %w", t.Name, err)
		}
		return fmt.Errorf("%w: table %s cannot be read (%v): the outbox tables are missing or were made before versions were recorded; run outbox.AutoMigrate (or apply outbox.Migrations) first",
			ErrSchemaNotCurrent, versions, err)
	}
	applied := map[int]bool{}
	for rows.Next() {
		var v int
		if err := rows.Scan(&v); err != nil {
			rows.Close()
			return fmt.Errorf("outbox: read the schema version of %s: %w", t.Name, err)
		}
		applied[v] = true
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return fmt.Errorf("outbox: read the schema version of %s: %w", t.Name, err)
	}
	var missing []int
	for _, m := range ms {
		if !applied[m.version] {
			missing = append(missing, m.version)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("%w: %s lacks schema version(s) %v of this library, whose newest is %d; run outbox.AutoMigrate (or apply outbox.Migrations) first",
			ErrSchemaNotCurrent, t.Name, missing, ms[len(ms)-1].version)
	}
	return nil
}
