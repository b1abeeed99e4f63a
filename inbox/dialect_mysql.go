package inbox

import (
	"context"
	"fmt"
	"time"

	"gorm.io/gorm"
)

// mysqlDialect serves MySQL and MariaDB (gorm.io/driver/mysql). Their DDL
// commits implicitly, so migrations queue on a named lock instead of a
// transaction, and each step's statements are idempotent.
type mysqlDialect struct{}

func (mysqlDialect) quote(ident string) string { return "`" + ident + "`" }

// timeArg is the time in UTC: the driver sends a time.Time as the wall
// clock of its configured location, which is UTC unless the DSN's loc
// says otherwise.
func (mysqlDialect) timeArg(t time.Time) any { return t.UTC() }

func (mysqlDialect) bootstrap(t tables) []string {
	return []string{
		"CREATE TABLE IF NOT EXISTS " + t.schema + ` (
	id      INT NOT NULL PRIMARY KEY,
	version INT NOT NULL
) ENGINE = InnoDB`,
		"INSERT INTO " + t.schema + " (id, version) VALUES (1, 0) ON DUPLICATE KEY UPDATE id = id",
	}
}

// steps: ids compare byte for byte (utf8mb4_bin), as on the other
// engines, so that ids differing in case or accents are different ids.
func (mysqlDialect) steps(t tables) [][]string {
	return [][]string{{
		"CREATE TABLE IF NOT EXISTS " + t.records + ` (
	message_id   VARCHAR(255) NOT NULL,
	message_type VARCHAR(255) NULL,
	handled_at   DATETIME(6)  NOT NULL,
	PRIMARY KEY (message_id),
	KEY ` + t.index + ` (handled_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin`,
	}}
}

// locked holds GET_LOCK on one connection while fn runs; the lock is the
// server's, per name, so concurrent migrations in any process queue.
func (mysqlDialect) locked(ctx context.Context, db *gorm.DB, t tables, fn func(q execer) error) error {
	sqlDB, err := db.DB()
	if err != nil {
		return err
	}
	conn, err := sqlDB.Conn(ctx)
	if err != nil {
		return err
	}
	defer conn.Close()
	name := fmt.Sprintf("gorm-outbox-inbox:%d", lockKey(t))
	var got *int
	if err := conn.QueryRowContext(ctx, "SELECT GET_LOCK(?, 60)", name).Scan(&got); err != nil {
		return err
	}
	if got == nil || *got != 1 {
		return fmt.Errorf("lock %s not granted within 60s", name)
	}
	defer func() { _, _ = conn.ExecContext(context.Background(), "SELECT RELEASE_LOCK(?)", name) }()
	return fn(conn)
}

// insert inserts plainly and, when that fails, looks for the id with a
// locking read: a duplicate-key error leaves the transaction usable, and
// the locking read sees the latest committed rows (not the transaction's
// snapshot), so the id is found exactly when another delivery committed
// it. This needs no error codes of the driver and does not depend on how
// the connection counts affected rows (clientFoundRows). A concurrent
// delivery's uncommitted insert of the id makes ours wait for its end.
// An insert that failed while the id is not recorded is retried by Handle
// in a new transaction.
func (mysqlDialect) insert(tx *gorm.DB, t tables, id string, typ *string, now time.Time) (bool, error) {
	err := tx.Exec("INSERT INTO "+t.records+" (message_id, message_type, handled_at) VALUES (?, ?, ?)", id, typ, now.UTC()).Error
	if err == nil {
		return true, nil
	}
	var n int64
	if qerr := tx.Raw("SELECT COUNT(*) FROM "+t.records+" WHERE message_id = ? LOCK IN SHARE MODE", id).Scan(&n).Error; qerr != nil {
		return false, err
	}
	if n == 0 {
		// Typically a deadlock: deliveries that waited for one that rolled
		// back each hold a shared lock on the id, and each one's insert
		// waits for the others'. InnoDB rolled ours back; Handle starts
		// it again.
		return false, &retryError{err: err}
	}
	return false, nil
}

// cleanupSQL: MySQL refuses LIMIT in an IN subquery, but has DELETE ...
// LIMIT.
func (mysqlDialect) cleanupSQL(t tables) string {
	return "DELETE FROM " + t.records + " WHERE handled_at < ? ORDER BY handled_at LIMIT ?"
}
