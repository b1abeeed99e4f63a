package outbox

import (
	"fmt"

	"gorm.io/gorm"
)

// AutoMigrate creates the outbox table, its sequence table and their
// indexes if they do not exist, in one transaction. It uses the table name
// of the plugin registered on db, or [DefaultTable] when there is none.
// It is safe to call at every start-up and from many replicas at once (on
// PostgreSQL, concurrent calls queue on an advisory lock); it never alters
// or drops existing tables.
func AutoMigrate(db *gorm.DB) error {
	t := tablesFor(DefaultTable)
	if p, err := pluginOf(db); err == nil {
		t = p.tables
	}
	d, err := dialectOf(db)
	if err != nil {
		return err
	}
	return db.Transaction(func(tx *gorm.DB) error {
		for _, stmt := range d.schema(t) {
			if err := tx.Exec(stmt).Error; err != nil {
				return fmt.Errorf("outbox: migrate %s: %w", t.name, err)
			}
		}
		return nil
	})
}
