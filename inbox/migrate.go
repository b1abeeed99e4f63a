package inbox

import (
	"context"
	"fmt"
	"strconv"
)

// Migrate creates the inbox table and its index, or brings them to the
// schema this package expects. It is versioned: the schema's version is
// recorded in the table named like the inbox table plus "_schema", and
// only the steps after the recorded version run. It is safe to call at
// every start-up and from many processes at once: concurrent calls queue
// (on a transaction-level advisory lock on PostgreSQL, the database's
// write lock on SQLite, a named lock on MySQL/MariaDB) and the later ones
// find nothing to do. On PostgreSQL and SQLite a migration runs in one
// transaction; it never drops or rewrites data. A schema newer than this
// package knows yields [ErrSchemaTooNew] and changes nothing.
func (in *Inbox) Migrate(ctx context.Context) error {
	steps := in.d.steps(in.t)
	err := in.d.locked(ctx, in.db, in.t, func(q execer) error {
		for _, stmt := range in.d.bootstrap(in.t) {
			if _, err := q.ExecContext(ctx, stmt); err != nil {
				return err
			}
		}
		var version int
		if err := q.QueryRowContext(ctx, `SELECT version FROM `+in.t.schema+` WHERE id = 1`).Scan(&version); err != nil {
			return err
		}
		if version > len(steps) {
			return fmt.Errorf("%w: %s is at version %d, this package knows %d", ErrSchemaTooNew, in.t.name, version, len(steps))
		}
		for v := version; v < len(steps); v++ {
			for _, stmt := range steps[v] {
				if _, err := q.ExecContext(ctx, stmt); err != nil {
					return fmt.Errorf("step %d: %w", v+1, err)
				}
			}
			if _, err := q.ExecContext(ctx, `UPDATE `+in.t.schema+` SET version = `+strconv.Itoa(v+1)+` WHERE id = 1`); err != nil {
				return fmt.Errorf("step %d: record version: %w", v+1, err)
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("inbox: migrate %s: %w", in.t.name, err)
	}
	return nil
}
