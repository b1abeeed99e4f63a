package dialect

import (
	"context"
	"database/sql"
	"fmt"
	"strconv"
	"strings"
	"time"

	"gorm.io/gorm"
)

// The MySQL dialect: MySQL 8.0+ and MariaDB 10.6+ (they brought SKIP
// LOCKED and JSON_TABLE), through gorm.io/driver/mysql, tested on MariaDB
// 10.11. The write is in mysql_write.go (and what the plugin asks of it
// in mysql_plugin.go), the transactions in mysql_tx.go. The schema
// (migrations/mysql) says why keys are VARBINARY and which generated
// columns stand in for partial indexes.
//
// Claimable rows are those with due_at <= now: the generated column folds
// the state, next_attempt_at and locked_until into one time, so that the
// claim reads its index (due_at, id) in order and stops after the batch,
// locking only the rows it keeps. Undelivered rows of an aggregate are
// found through (aggregate_type, undelivered_id, aggregate_sequence).
//
// Placeholders. MySQL's are bare ? marks, taken in the order of the text,
// each once. The statements of a claim's transaction (ClaimTx) are bound
// by mysqlTx, which also takes numbered ones (?1, ?2, ...) as SQLite does,
// so that an argument serves twice or out of order. The others run on the
// pool as they are: they read their arguments first, in the order given,
// into a derived table of one row, p, with their types, and refer to its
// columns; only LIMIT and a settle's list of ids, the last argument,
// take a ? of their own.
//
// Lists are JSON text, read with JSON_TABLE. A multi-table UPDATE joined
// to JSON_TABLE finds its rows by primary key; MariaDB runs a
// single-table UPDATE ... WHERE id IN (subquery) as a scan of the table.
//
// There is no UPDATE ... RETURNING: the statements that return the rows
// they change (lease, revive, requeue) are statement lists, run one after
// the other in the claim's transaction (mysqlTx), the last one returning
// the rows. Revive and requeue lock their rows and keep their ids in the
// session variable @outbox_ids from one statement to the next.

func (mysqlDialect) Name() string { return "mysql" }

func (mysqlDialect) Tables(name string) Tables {
	return Tables{Name: name, Records: mysqlQuote(name), Sequences: mysqlQuote(name + "_sequences"), Quote: mysqlQuote}
}

func mysqlQuote(ident string) string { return "`" + strings.ReplaceAll(ident, "`", "``") + "`" }

func (mysqlDialect) Bind(query string) string { return query }

// ReadTime: the driver reads a DATETIME column as a time.Time (parseTime).
// The one value that is no time, the zero date, which MariaDB's default
// sql_mode lets a hand-written row hold, it reads as the zero time, and
// Time refuses that.
func (mysqlDialect) ReadTime(column string) string { return column }

func (mysqlDialect) IDList(ids []int64) any { return jsonList(ids) }

func (mysqlDialect) TextList(s []string) any { return jsonTexts(s) }

func (mysqlDialect) EventList(events []Position) []any { return jsonEvents(events) }

// The columns JSON_TABLE reads a list into, and a time argument of p.
const (
	mysqlIDs    = `'$[*]' COLUMNS (id BIGINT PATH '$')`
	mysqlTexts  = `'$[*]' COLUMNS (v VARBINARY(1020) PATH '$')`
	mysqlEvents = `'$[*]' COLUMNS (i FOR ORDINALITY, typ VARBINARY(1020) PATH '$[0]', agg VARBINARY(1020) PATH '$[1]', seq BIGINT PATH '$[2]')`
	mysqlTime   = `CAST(? AS DATETIME(6))`
)

// mysqlNoLimit is a LIMIT that keeps all the rows of a derived table and
// keeps it from being merged into the query around it.
const mysqlNoLimit = `18446744073709551615`

// mysqlThen separates the statements of a statement list (mysqlTx).
const mysqlThen = "\n;\n"

func (mysqlDialect) Statements(t Tables) Statements {
	r := t.Records
	return Statements{
		// The claim's transaction: numbered placeholders (mysqlTx).
		Window: `SELECT id, aggregate_type, aggregate_id, aggregate_sequence FROM ` + r + `
WHERE due_at <= ?1
ORDER BY due_at, id
LIMIT ?2
FOR UPDATE SKIP LOCKED`,
		WindowShard: `SELECT id, aggregate_type, aggregate_id, aggregate_sequence FROM ` + r + `
WHERE shard = ?3 AND due_at <= ?1
ORDER BY due_at, id
LIMIT ?2
FOR UPDATE SKIP LOCKED`,

		// One lookup per event through the aggregate index, a LEFT JOIN
		// rather than a subquery run per row, into a derived table that
		// LIMIT keeps from being merged: the sort into the list's order is
		// then one of the narrow rows (i, state) it holds, not of
		// JSON_TABLE's rows with their VARBINARY(1020) columns, which
		// MariaDB sorts by position and reads back.
		Undelivered: `SELECT s.state FROM (
	SELECT u.i, CASE
		WHEN p.id IS NULL THEN NULL
		WHEN p.delivery_state = 'delivering' AND p.locked_until > ?1 THEN 'flight'
		WHEN p.delivery_state IN ('pending', 'retry') AND p.next_attempt_at <= ?1 AND p.next_attempt_at <= (
			SELECT n.next_attempt_at FROM ` + r + ` n
			WHERE n.aggregate_type = p.aggregate_type AND n.undelivered_id = p.aggregate_id
				AND n.aggregate_sequence = p.aggregate_sequence + 1) THEN 'flight'
		ELSE 'waits' END AS state
	FROM JSON_TABLE(?2, ` + mysqlEvents + `) u
	LEFT JOIN ` + r + ` p ON p.aggregate_type = u.typ AND p.undelivered_id = u.agg AND p.aggregate_sequence = u.seq
	LIMIT ` + mysqlNoLimit + `
) s
ORDER BY s.i`,

		Lease: `UPDATE ` + r + ` x JOIN JSON_TABLE(?4, ` + mysqlIDs + `) j ON x.id = j.id
SET x.delivery_state = 'delivering', x.batch_id = ?1, x.locked_until = ?2, x.next_attempt_at = ?2, x.updated_at = ?3` + mysqlThen +
			`SELECT x.id, x.event_id, x.event_type, x.aggregate_type, x.aggregate_id, x.aggregate_sequence,
	x.idempotency_key, x.payload, x.headers, x.occurred_at, x.delivery_attempts
FROM JSON_TABLE(?4, ` + mysqlIDs + `) j
JOIN ` + r + ` x ON x.id = j.id AND x.batch_id = ?1`,

		Revive: `SELECT JSON_ARRAYAGG(s.id) INTO @outbox_ids FROM (
	SELECT id FROM ` + r + `
	WHERE failed_at IS NOT NULL AND failure_kind = 'exhausted' AND revivals < ?2
	ORDER BY failed_at, id
	LIMIT ?3
	FOR UPDATE SKIP LOCKED
) s` + mysqlThen + mysqlMoveBack(r, "x.revivals + 1") + mysqlThen + mysqlMoved(r),

		Requeue: `SELECT JSON_ARRAYAGG(s.id) INTO @outbox_ids FROM (
	SELECT id FROM ` + r + `
	WHERE failed_at IS NOT NULL
		AND (?3 IS NULL OR updated_at < ?3)
		AND (?4 IS NULL OR event_id IN (SELECT e.v FROM JSON_TABLE(?4, ` + mysqlTexts + `) e))
		AND (?5 IS NULL OR event_type IN (SELECT e.v FROM JSON_TABLE(?5, ` + mysqlTexts + `) e))
	ORDER BY failed_at, id
	LIMIT ?2
	FOR UPDATE SKIP LOCKED
) s` + mysqlThen + mysqlMoveBack(r, "0") + mysqlThen + mysqlMoved(r),

		// By the index on failed_at, which is updated_at for a failed row.
		Discard: `SELECT id, event_id, event_type, aggregate_type, aggregate_id, aggregate_sequence
FROM ` + r + `
WHERE failed_at IS NOT NULL
	AND (?2 IS NULL OR failed_at < ?2)
	AND (?3 IS NULL OR event_id IN (SELECT e.v FROM JSON_TABLE(?3, ` + mysqlTexts + `) e))
	AND (?4 IS NULL OR event_type IN (SELECT e.v FROM JSON_TABLE(?4, ` + mysqlTexts + `) e))
ORDER BY failed_at, id
LIMIT ?1
FOR UPDATE`,

		// On the pool: the arguments in p, in order, but for the list of
		// ids, the last, which JSON_TABLE reads from its own placeholder:
		// read from a column of p, it made the settle slower.
		SettleDelivered: `UPDATE ` + r + ` x
JOIN (SELECT ` + mysqlTime + ` AS at, ? AS batch) p
JOIN JSON_TABLE(?, ` + mysqlIDs + `) j ON x.id = j.id
SET x.delivery_state = 'delivered', x.delivery_attempts = x.delivery_attempts + 1, x.next_attempt_at = p.at,
	x.last_error = NULL, x.failure_kind = NULL, x.locked_until = NULL, x.delivered_at = p.at, x.updated_at = p.at
WHERE x.batch_id = p.batch AND x.delivery_state = 'delivering'`,

		SettleOther: `UPDATE ` + r + ` x
JOIN (SELECT CAST(? AS CHAR(16)) AS state, CAST(? AS SIGNED) AS attempts, ` + mysqlTime + ` AS next_at,
	CAST(? AS CHAR) AS last_error, CAST(? AS CHAR(16)) AS kind, ` + mysqlTime + ` AS at, ? AS batch) p
JOIN JSON_TABLE(?, ` + mysqlIDs + `) j ON x.id = j.id
SET x.delivery_state = p.state, x.delivery_attempts = p.attempts, x.next_attempt_at = p.next_at,
	x.last_error = coalesce(p.last_error, x.last_error), x.failure_kind = p.kind, x.locked_until = NULL,
	x.updated_at = p.at
WHERE x.batch_id = p.batch AND x.delivery_state = 'delivering'`,

		// Each lookup runs once per aggregate through the aggregate index:
		// the aggregate's first undelivered row (ORDER BY ... LIMIT 1 reads
		// one index entry, where MariaDB's min of a correlated subquery
		// reads them all), then the head itself.
		Blockers: `SELECT g.bt, g.ba, g.hs, g.state, CASE WHEN g.state = 'failed' THEN q.lease_end ELSE g.next_at END
FROM (
	SELECT m.bt, m.ba, m.hs, h.next_attempt_at AS next_at, CASE
			WHEN h.delivery_state = 'failed' THEN 'failed'
			WHEN h.delivery_state IN ('pending', 'retry') AND h.due_at > m.fn THEN h.delivery_state
			WHEN h.delivery_state = 'delivering' AND h.locked_until <= m.at AND h.due_at > m.fn THEN 'delivering'
		END AS state
	FROM (
		SELECT s.bt, s.ba, s.fn, s.at, (SELECT x.aggregate_sequence FROM ` + r + ` x
			WHERE x.aggregate_type = s.bt AND x.undelivered_id = s.ba
			ORDER BY x.aggregate_sequence LIMIT 1) AS hs
		FROM (
			SELECT c.aggregate_type AS bt, c.aggregate_id AS ba, min(c.due_at) AS fn, min(c.at) AS at
			FROM (
				SELECT y.aggregate_type, y.aggregate_id, y.aggregate_sequence, y.due_at, p.at
				FROM (SELECT ` + mysqlTime + ` AS at) p
				JOIN ` + r + ` y ON y.due_at <= p.at
				ORDER BY y.due_at, y.id
				LIMIT ?
			) c
			GROUP BY c.aggregate_type, c.aggregate_id
			HAVING max(c.aggregate_sequence) > 1
		) s
	) m
	JOIN ` + r + ` h ON h.aggregate_type = m.bt AND h.undelivered_id = m.ba AND h.aggregate_sequence = m.hs
) g
JOIN (SELECT ` + mysqlTime + ` AS lease_end) q
WHERE g.state IS NOT NULL`,

		Park: `UPDATE ` + r + ` x
JOIN (SELECT ` + mysqlTime + ` AS until_at, ` + mysqlTime + ` AS at, CAST(? AS BINARY) AS typ, CAST(? AS BINARY) AS agg,
	CAST(? AS SIGNED) AS seq, CAST(? AS CHAR(16)) AS state) p
	ON x.aggregate_type = p.typ AND x.undelivered_id = p.agg AND x.aggregate_sequence > p.seq
JOIN ` + r + ` h ON h.aggregate_type = p.typ AND h.undelivered_id = p.agg AND h.aggregate_sequence = p.seq
	AND h.delivery_state = p.state
SET x.next_attempt_at = p.until_at, x.updated_at = p.at
WHERE x.delivery_state IN ('pending', 'retry') AND x.next_attempt_at < p.until_at`,

		Unpark: `UPDATE ` + r + ` x
JOIN (SELECT ` + mysqlTime + ` AS at, ? AS events) p
JOIN JSON_TABLE(p.events, ` + mysqlEvents + `) u ON x.aggregate_type = u.typ AND x.undelivered_id = u.agg
SET x.next_attempt_at = p.at, x.updated_at = p.at
WHERE x.delivery_state IN ('pending', 'retry') AND x.next_attempt_at > p.at`,

		// A single-table DELETE takes ORDER BY and LIMIT.
		Cleanup: `DELETE FROM ` + r + ` WHERE delivered_at < ` + mysqlTime + ` AND delivery_state = 'delivered'
ORDER BY delivered_at
LIMIT ?`,

		Counts: `SELECT delivery_state, count(*) FROM ` + r + ` GROUP BY delivery_state`,
		OldestDue: `SELECT min(x.next_attempt_at) FROM (SELECT ` + mysqlTime + ` AS at) p
JOIN ` + r + ` x ON x.due_at <= p.at`,
		LastFailure: `SELECT last_error FROM ` + r + ` WHERE failed_at IS NOT NULL ORDER BY failed_at DESC, id DESC LIMIT 1`,
	}
}

// mysqlMoveBack is the statement of revive and requeue that moves the
// rows @outbox_ids names back to pending, with revivals set to revivals;
// a row that is no longer failed (a requeue of it ran meanwhile) stays.
func mysqlMoveBack(r, revivals string) string {
	return `UPDATE ` + r + ` x JOIN JSON_TABLE(@outbox_ids, ` + mysqlIDs + `) j ON x.id = j.id
SET x.delivery_state = 'pending', x.delivery_attempts = 0, x.revivals = ` + revivals + `, x.failure_kind = NULL,
	x.next_attempt_at = ?1, x.updated_at = ?1, x.locked_until = NULL, x.batch_id = NULL
WHERE x.delivery_state = 'failed'`
}

// mysqlMoved returns the aggregates of the rows mysqlMoveBack moved.
func mysqlMoved(r string) string {
	return `SELECT x.aggregate_type, x.aggregate_id FROM JSON_TABLE(@outbox_ids, ` + mysqlIDs + `) j
JOIN ` + r + ` x ON x.id = j.id
WHERE x.delivery_state = 'pending' AND x.updated_at = ?1`
}

// ClaimTx runs fn in a READ COMMITTED transaction (readCommittedTx), again
// after a deadlock or a lock wait timeout, on mysqlTx.
func (mysqlDialect) ClaimTx(ctx context.Context, db *gorm.DB, fn func(q Querier) error) error {
	return readCommittedTx(ctx, db, func(tx *sql.Tx) error { return fn(mysqlTx{tx}) })
}

// mysqlTx is a claim's transaction. It runs a statement list (statements
// separated by mysqlThen) one statement after the other, each with the
// arguments it names, and returns the rows of the last; and it binds
// numbered placeholders.
type mysqlTx struct{ tx *sql.Tx }

func (q mysqlTx) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	var res sql.Result
	for _, stmt := range strings.Split(query, mysqlThen) {
		text, bound := bindMySQL(stmt, args)
		var err error
		if res, err = q.tx.ExecContext(ctx, text, bound...); err != nil {
			return nil, err
		}
	}
	return res, nil
}

func (q mysqlTx) QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error) {
	stmts := strings.Split(query, mysqlThen)
	for _, stmt := range stmts[:len(stmts)-1] {
		text, bound := bindMySQL(stmt, args)
		if _, err := q.tx.ExecContext(ctx, text, bound...); err != nil {
			return nil, err
		}
	}
	text, bound := bindMySQL(stmts[len(stmts)-1], args)
	return q.tx.QueryContext(ctx, text, bound...)
}

// bindMySQL rewrites numbered placeholders (?1, ?2, ...) into bare ones,
// and returns the arguments in the order of the text. A statement without
// numbered placeholders takes args as they are, and one without any none.
// Our statements hold no literal question mark.
func bindMySQL(stmt string, args []any) (string, []any) {
	if !strings.Contains(stmt, "?") {
		return stmt, nil
	}
	var (
		b        strings.Builder
		bound    []any
		numbered bool
	)
	b.Grow(len(stmt))
	for i := 0; i < len(stmt); i++ {
		b.WriteByte(stmt[i])
		if stmt[i] != '?' {
			continue
		}
		j := i + 1
		for j < len(stmt) && stmt[j] >= '0' && stmt[j] <= '9' {
			j++
		}
		if n, err := strconv.Atoi(stmt[i+1 : j]); err == nil && n >= 1 && n <= len(args) {
			bound = append(bound, args[n-1])
			numbered = true
			i = j - 1
		}
	}
	if !numbered {
		return stmt, args
	}
	return b.String(), bound
}

func (mysqlDialect) CheckPool(db *gorm.DB) error { return mysqlCheckPool(db) }

// Listen: MySQL has no notifications; the in-process nudge and the poll
// wake dispatchers.
func (mysqlDialect) Listen(context.Context, *gorm.DB, Tables, func()) error { return ErrNoListen }

// MigrateTx: MySQL commits each DDL statement on its own, so a migration
// is no transaction; each of ours is written to be run again after a
// failure (CREATE TABLE IF NOT EXISTS, a table and its indexes in one
// statement). Concurrent migrations queue on a named lock (GET_LOCK) that
// the connection running them holds; its name holds the database's and
// the table's, hashed into its 64 characters.
func (mysqlDialect) MigrateTx(ctx context.Context, db *gorm.DB, t Tables, fn func(q Querier) error) error {
	sqlDB, err := db.DB()
	if err != nil {
		return err
	}
	conn, err := sqlDB.Conn(ctx)
	if err != nil {
		return err
	}
	defer conn.Close()
	const lock = `CONCAT('gorm-outbox:', SHA1(CONCAT(DATABASE(), '.', ?)))`
	var got sql.NullInt64
	if err := conn.QueryRowContext(ctx, `SELECT GET_LOCK(`+lock+`, ?)`, t.Name, int(migrateLockWait.Seconds())).Scan(&got); err != nil {
		return err
	}
	if got.Int64 != 1 {
		return fmt.Errorf("another migration of %s held its lock for %v", t.Name, migrateLockWait)
	}
	defer conn.ExecContext(context.WithoutCancel(ctx), `DO RELEASE_LOCK(`+lock+`)`, t.Name)
	return fn(conn)
}

// migrateLockWait is how long a migration waits for another one.
const migrateLockWait = time.Minute
