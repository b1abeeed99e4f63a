package dialect

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"hash/fnv"
	"reflect"
	"strconv"
	"strings"
	"time"

	"gorm.io/gorm"
)

// postgresDialect is PostgreSQL, through pgx (gorm.io/driver/postgres).
// Claims lock rows with FOR UPDATE SKIP LOCKED, so any number of
// dispatchers share a table; lists travel as arrays; a claim's lease and a
// settle commit with synchronous_commit off, in their own transactions
// only (see Dispatcher); listeners hear commits through LISTEN/NOTIFY.
type postgresDialect struct{}

func (postgresDialect) Name() string { return "postgres" }

func (postgresDialect) Tables(name string) Tables { return TablesFor(name) }

func (postgresDialect) Bind(query string) string { return bindNumbered(query) }

func (postgresDialect) TimeArg(t time.Time) any { return t.UTC() }

// ReadTime: a timestamptz column holds nothing but times.
func (postgresDialect) ReadTime(column string) string { return column }

func (postgresDialect) IDList(ids []int64) any { return ids }

func (postgresDialect) TextList(s []string) any {
	if s == nil {
		return nil
	}
	return s
}

func (postgresDialect) EventList(events []Position) []any {
	types, ids, seqs := make([]string, len(events)), make([]string, len(events)), make([]int64, len(events))
	for i, e := range events {
		types[i], ids[i], seqs[i] = e.Aggregate.Type, e.Aggregate.ID, e.Seq
	}
	return []any{types, ids, seqs}
}

// Statements. Claimable is written out in each statement that claims:
// delivery_state IN ('pending', 'retry', 'delivering') AND
// next_attempt_at <= now AND (locked_until IS NULL OR locked_until <= now);
// the partial due index serves its first two terms in due order. Lists
// are arrays, looked up one element at a time through the aggregate index
// (a scalar subquery or a nested loop over unnest), so that the planner
// never has to guess their contents. The lease and the settles set
// synchronous_commit off for their own transaction, through set_config in
// an uncorrelated subquery that runs once, before the commit.
func (postgresDialect) Statements(t Tables) Statements {
	r := t.Records
	return Statements{
		// claim is the oldest-first claim in one statement, so in one
		// implicit transaction and one round trip: the window (w), locked
		// as it is read; per aggregate its lowest sequence there and the
		// state of the event before it (s: NULL when delivered or gone, as
		// in undelivered); of the aggregates whose predecessor is NULL,
		// the window's rows whose offset from that lowest sequence equals
		// their rank in sequence order, which is exactly the run without a
		// gap or a repeat (pick); and the lease of those. It always
		// returns at least one row: the window's size and whether a
		// predecessor waits (not in flight), then each leased row's
		// columns, NULL when it leased none. Its text is pgClaim's, below.
		Claim: pgClaim(r, ""),

		// claimShard is claim with its window limited to one shard ($5) of
		// the aggregates, by a hash of aggregate type and id: the
		// expression of the index outbox_records_due_shard (migration 3),
		// which serves the window in its order.
		ClaimShard: pgClaim(r, `
		AND (hashtext(aggregate_type || '/' || aggregate_id) & 7) = $5`),

		SettleDelivered: `UPDATE ` + r + ` SET
	delivery_state = 'delivered', delivery_attempts = delivery_attempts + 1, next_attempt_at = $1,
	last_error = NULL, failure_kind = NULL, locked_until = NULL, delivered_at = $1, updated_at = $1
WHERE id = ANY($3) AND batch_id = $2 AND delivery_state = 'delivering'
	AND (SELECT set_config('synchronous_commit', 'off', true)) IS NOT NULL`,

		SettleOther: `UPDATE ` + r + ` SET
	delivery_state = $1, delivery_attempts = $2, next_attempt_at = $3,
	last_error = coalesce($4, last_error), failure_kind = $5, locked_until = NULL, updated_at = $6
WHERE id = ANY($8) AND batch_id = $7 AND delivery_state = 'delivering'
	AND (SELECT set_config('synchronous_commit', 'off', true)) IS NOT NULL`,

		// Every lookup is a scalar subquery run once per aggregate through
		// the aggregate index: joined instead, the planner may drive the
		// query from the heads' condition, misjudged by statistics taken
		// while the backlog was due, and scan every row that is not due.
		Blockers: `WITH seen AS MATERIALIZED (
	SELECT c.aggregate_type AS bt, c.aggregate_id AS ba, min(c.next_attempt_at) AS fn FROM (
		SELECT aggregate_type, aggregate_id, aggregate_sequence, next_attempt_at FROM ` + r + `
		WHERE delivery_state IN ('pending', 'retry', 'delivering') AND next_attempt_at <= $1
		ORDER BY next_attempt_at, id
		LIMIT $2
	) c
	GROUP BY c.aggregate_type, c.aggregate_id
	HAVING max(c.aggregate_sequence) > 1
), heads AS MATERIALIZED (
	SELECT bt, ba, fn, (SELECT min(m.aggregate_sequence) FROM ` + r + ` m
		WHERE m.aggregate_type = bt AND m.aggregate_id = ba AND m.delivery_state <> 'delivered') AS hs
	FROM seen
), waits AS MATERIALIZED (
	SELECT bt, ba, hs, (SELECT CASE
			WHEN h.delivery_state = 'failed' THEN 'failed'
			WHEN h.delivery_state IN ('pending', 'retry') AND h.next_attempt_at > fn THEN h.delivery_state
			WHEN h.delivery_state = 'delivering' AND h.locked_until <= $1 AND h.next_attempt_at > fn THEN 'delivering'
		END FROM ` + r + ` h
		WHERE h.aggregate_type = bt AND h.aggregate_id = ba AND h.aggregate_sequence = hs
			AND h.delivery_state <> 'delivered') AS state
	FROM heads
	WHERE hs IS NOT NULL
)
SELECT bt, ba, hs, state, CASE WHEN state = 'failed' THEN $3 ELSE (SELECT h.next_attempt_at FROM ` + r + ` h
		WHERE h.aggregate_type = bt AND h.aggregate_id = ba AND h.aggregate_sequence = hs) END
FROM waits WHERE state IS NOT NULL`,

		Park: `UPDATE ` + r + ` SET next_attempt_at = $1, updated_at = $2
WHERE aggregate_type = $3 AND aggregate_id = $4 AND aggregate_sequence > $5
	AND delivery_state IN ('pending', 'retry') AND next_attempt_at < $1
	AND EXISTS (SELECT 1 FROM ` + r + ` h
		WHERE h.aggregate_type = $3 AND h.aggregate_id = $4 AND h.aggregate_sequence = $5
			AND h.delivery_state = $6)`,

		Unpark: `UPDATE ` + r + ` SET next_attempt_at = $1, updated_at = $1
WHERE delivery_state IN ('pending', 'retry') AND next_attempt_at > $1
	AND (aggregate_type, aggregate_id) IN (SELECT u.typ, u.agg FROM unnest($2::text[], $3::text[], $4::bigint[]) AS u(typ, agg, seq))`,

		Revive: `UPDATE ` + r + ` SET
	delivery_state = 'pending', delivery_attempts = 0, revivals = revivals + 1, failure_kind = NULL,
	next_attempt_at = $1, updated_at = $1, locked_until = NULL, batch_id = NULL
WHERE id IN (
	SELECT id FROM ` + r + `
	WHERE delivery_state = 'failed' AND failure_kind = 'exhausted' AND revivals < $2
	ORDER BY updated_at, id
	LIMIT $3
	FOR UPDATE SKIP LOCKED
)
RETURNING aggregate_type, aggregate_id`,

		Requeue: `UPDATE ` + r + ` SET
	delivery_state = 'pending', delivery_attempts = 0, revivals = 0, failure_kind = NULL,
	next_attempt_at = $1, updated_at = $1, locked_until = NULL, batch_id = NULL
WHERE id IN (
	SELECT id FROM ` + r + `
	WHERE delivery_state = 'failed'
		AND ($3::timestamptz IS NULL OR updated_at < $3)
		AND ($4::text[] IS NULL OR event_id = ANY($4))
		AND ($5::text[] IS NULL OR event_type = ANY($5))
	ORDER BY updated_at, id
	LIMIT $2
	FOR UPDATE SKIP LOCKED
)
RETURNING aggregate_type, aggregate_id`,

		Discard: `SELECT id, event_id, event_type, aggregate_type, aggregate_id, aggregate_sequence
FROM ` + r + `
WHERE delivery_state = 'failed'
	AND ($2::timestamptz IS NULL OR updated_at < $2)
	AND ($3::text[] IS NULL OR event_id = ANY($3))
	AND ($4::text[] IS NULL OR event_type = ANY($4))
ORDER BY updated_at, id
LIMIT $1
FOR UPDATE`,

		Cleanup: `DELETE FROM ` + r + ` WHERE id IN (
	SELECT id FROM ` + r + ` WHERE delivery_state = 'delivered' AND delivered_at < $1
	ORDER BY delivered_at
	LIMIT $2
	FOR UPDATE SKIP LOCKED
)`,

		Counts: `SELECT delivery_state, count(*) FROM ` + r + ` GROUP BY delivery_state`,
		OldestDue: `SELECT min(next_attempt_at) FROM ` + r + `
WHERE delivery_state IN ('pending', 'retry', 'delivering') AND next_attempt_at <= $1
	AND (locked_until IS NULL OR locked_until <= $1)`,
		LastFailure: `SELECT last_error FROM ` + r + ` WHERE delivery_state = 'failed' ORDER BY updated_at DESC, id DESC LIMIT 1`,
	}
}

// pgClaim returns the one-statement claim on table r, its window narrowed
// by the condition window ("" for none, or "AND ...").
func pgClaim(r, window string) string {
	return `WITH w AS MATERIALIZED (
	SELECT id, aggregate_type, aggregate_id, aggregate_sequence FROM ` + r + `
	WHERE delivery_state IN ('pending', 'retry', 'delivering') AND next_attempt_at <= $3
		AND (locked_until IS NULL OR locked_until <= $3)` + window + `
	ORDER BY next_attempt_at, id
	LIMIT $4
	FOR UPDATE SKIP LOCKED
), s AS MATERIALIZED (
	SELECT f.aggregate_type, f.aggregate_id, f.first, CASE WHEN f.first = 1 THEN NULL ELSE (
		SELECT CASE
			WHEN p.delivery_state = 'delivering' AND p.locked_until > $3 THEN 'flight'
			WHEN p.delivery_state IN ('pending', 'retry') AND p.next_attempt_at <= $3 AND p.next_attempt_at <= (
				SELECT n.next_attempt_at FROM ` + r + ` n
				WHERE n.aggregate_type = p.aggregate_type AND n.aggregate_id = p.aggregate_id
					AND n.aggregate_sequence = p.aggregate_sequence + 1 AND n.delivery_state <> 'delivered') THEN 'flight'
			ELSE 'waits' END
		FROM ` + r + ` p
		WHERE p.aggregate_type = f.aggregate_type AND p.aggregate_id = f.aggregate_id
			AND p.aggregate_sequence = f.first - 1 AND p.delivery_state <> 'delivered') END AS pred
	FROM (SELECT aggregate_type, aggregate_id, min(aggregate_sequence) AS first FROM w GROUP BY aggregate_type, aggregate_id) f
), pick AS (
	SELECT x.id FROM (
		SELECT w.id, w.aggregate_sequence - s.first AS off,
			row_number() OVER (PARTITION BY w.aggregate_type, w.aggregate_id ORDER BY w.aggregate_sequence) - 1 AS rank
		FROM w JOIN s ON s.aggregate_type = w.aggregate_type AND s.aggregate_id = w.aggregate_id
		WHERE s.pred IS NULL
	) x
	WHERE x.off = x.rank
), leased AS (
	UPDATE ` + r + ` SET
		delivery_state = 'delivering', batch_id = $1, locked_until = $2, next_attempt_at = $2, updated_at = $3
	WHERE id IN (SELECT id FROM pick) AND (SELECT set_config('synchronous_commit', 'off', true)) IS NOT NULL
	RETURNING id, event_id, event_type, aggregate_type, aggregate_id, aggregate_sequence,
		idempotency_key, payload, headers, occurred_at, delivery_attempts
)
SELECT (SELECT count(*) FROM w), coalesce((SELECT bool_or(pred = 'waits') FROM s), false), leased.*
FROM (SELECT 1) one LEFT JOIN leased ON true`
}

// ClaimTx begins the claim's transaction on the pool: on a *sql.DB, or on
// a pool of the user's own that can begin one. It asks for READ COMMITTED
// (in the BEGIN itself, no extra round trip) rather than take the
// session's default: under REPEATABLE READ a claim's reads would not see
// what committed after its first one, and its lock statement would fail
// with a serialization error on a row another claim leased meanwhile.
func (postgresDialect) ClaimTx(ctx context.Context, db *gorm.DB, fn func(q Querier) error) error {
	return inTx(ctx, db, &sql.TxOptions{Isolation: sql.LevelReadCommitted}, fn)
}

// MigrateTx: DDL is transactional on PostgreSQL, so the whole migration
// is one transaction, and processes that migrate at the same start-up
// queue on an advisory lock named after the table instead of racing on
// the catalog.
func (postgresDialect) MigrateTx(ctx context.Context, db *gorm.DB, t Tables, fn func(q Querier) error) error {
	h := fnv.New32a()
	h.Write([]byte("gorm-outbox:" + t.Name))
	return inTx(ctx, db, nil, func(q Querier) error {
		if _, err := q.ExecContext(ctx, `SELECT pg_advisory_xact_lock(`+strconv.FormatUint(uint64(h.Sum32()), 10)+`)`); err != nil {
			return err
		}
		return fn(q)
	})
}

// CheckPool: a claim begins its transaction through the pool.
func (postgresDialect) CheckPool(db *gorm.DB) error {
	switch db.Statement.ConnPool.(type) {
	case gorm.TxBeginner, gorm.ConnPoolBeginner:
		return nil
	}
	return fmt.Errorf("the connection pool (%T) cannot begin transactions, which a claim needs", db.Statement.ConnPool)
}

// LockConflict: the dispatcher's statements never wait for a lock
// long enough to be ended for it.
func (postgresDialect) LockConflict(error) bool { return false }

// RejectsData: SQLSTATE class 22 is "data exception".
func (postgresDialect) RejectsData(err error) bool {
	code, ok := sqlState(err)
	return ok && strings.HasPrefix(code, "22")
}

// Listen holds one connection of db's pool for LISTEN, outside the pool's
// accounting, and discards it when done: a connection that listened is
// never handed back to the pool.
func (postgresDialect) Listen(ctx context.Context, db *gorm.DB, t Tables, wake func()) error {
	sqlDB, err := db.DB()
	if err != nil {
		return ErrNoListen
	}
	if sqlDB.Stats().MaxOpenConnections == 1 {
		// Listening would hold the pool's only connection, and every claim
		// would wait for it forever.
		return fmt.Errorf("%w: the pool has a single connection (SetMaxOpenConns(1))", ErrNoListen)
	}
	conn, err := sqlDB.Conn(ctx)
	if err != nil {
		return err
	}
	defer conn.Close()
	return conn.Raw(func(driverConn any) error {
		exec, ok := driverConn.(driver.ExecerContext)
		wait := notificationWaiter(driverConn)
		if !ok || wait == nil {
			return ErrNoListen
		}
		if _, err := exec.ExecContext(ctx, "LISTEN "+quote(t.Name), nil); err != nil {
			return errors.Join(err, driver.ErrBadConn)
		}
		// Rows may have committed while nobody listened.
		wake()
		for {
			if err := wait(ctx); err != nil {
				return errors.Join(err, driver.ErrBadConn)
			}
			wake()
		}
	})
}

// notificationWaiter returns the function that waits for the next
// notification on driverConn, or nil where the driver has none. pgx's
// database/sql connection (*stdlib.Conn, which gorm.io/driver/postgres
// opens) hands out its *pgx.Conn through Conn(), whose
// WaitForNotification(ctx) (*pgconn.Notification, error) waits; both are
// reached by name, so that this package does not import pgx and a program
// that does not use PostgreSQL does not link it.
func notificationWaiter(driverConn any) func(ctx context.Context) error {
	connOf := reflect.ValueOf(driverConn).MethodByName("Conn")
	if !connOf.IsValid() || connOf.Type().NumIn() != 0 || connOf.Type().NumOut() != 1 {
		return nil
	}
	pc := connOf.Call(nil)[0]
	if pc.Kind() == reflect.Pointer && pc.IsNil() {
		return nil
	}
	waitFor := pc.MethodByName("WaitForNotification")
	ctxType, errType := reflect.TypeFor[context.Context](), reflect.TypeFor[error]()
	if !waitFor.IsValid() {
		return nil
	}
	if wt := waitFor.Type(); wt.NumIn() != 1 || wt.In(0) != ctxType || wt.NumOut() != 2 || wt.Out(1) != errType {
		return nil
	}
	return func(ctx context.Context) error {
		out := waitFor.Call([]reflect.Value{reflect.ValueOf(ctx)})
		if err, _ := out[1].Interface().(error); err != nil {
			return err
		}
		return nil
	}
}

// NotifyCommitted notifies t's channel in a transaction of its own. The
// transaction commits asynchronously: it carries no data, so its commit
// need not wait for a WAL flush, and listeners are signalled at commit
// either way.
func (postgresDialect) NotifyCommitted(ctx context.Context, pool *sql.DB, t Tables) error {
	_, err := pool.ExecContext(ctx, `SELECT set_config('synchronous_commit', 'off', true), pg_notify($1, '')`, t.Name)
	return err
}

func (d postgresDialect) InsertEvent(ctx context.Context, conn gorm.ConnPool, t Tables, e *Record, now time.Time, notify bool) (bool, error) {
	// One round trip: the sequence upsert, the record insert and the
	// notification share a statement. The upsert's row lock serialises
	// writers of one aggregate until commit, which is what makes sequences
	// gapless and in commit order. The notification, like the rows, is
	// delivered only if the transaction commits.
	notifyExpr := "''"
	args := []any{e.AggregateType, e.AggregateID, e.ID, e.Type, e.Key, e.Payload, e.Headers, now.UTC(), e.OccurredAt.UTC()}
	if notify {
		notifyExpr = "pg_notify($10, '')::text"
		args = append(args, t.Name)
	}
	var (
		seq  int64
		void string
	)
	err := conn.QueryRowContext(ctx, `WITH seq AS (
	INSERT INTO `+t.Sequences+` AS s (aggregate_type, aggregate_id, last_sequence) VALUES ($1, $2, 1)
	ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET last_sequence = s.last_sequence + 1
	RETURNING last_sequence
), ins AS (
	INSERT INTO `+t.Records+` (event_id, event_type, aggregate_type, aggregate_id, aggregate_sequence,
		idempotency_key, payload, headers, delivery_state, delivery_attempts, next_attempt_at,
		occurred_at, created_at, updated_at)
	SELECT $3, $4, $1, $2, seq.last_sequence, $5, $6::jsonb, $7::jsonb, 'pending', 0, $8, $9, $8, $8 FROM seq
	ON CONFLICT (idempotency_key) DO NOTHING
	RETURNING aggregate_sequence
)
SELECT aggregate_sequence, `+notifyExpr+` FROM ins`, args...).Scan(&seq, &void)
	if errors.Is(err, sql.ErrNoRows) {
		return false, releaseSequence(ctx, d, conn, t, e)
	}
	return err == nil, err
}

// Settings: autovacuum, on the server and on the outbox tables (their
// autovacuum_enabled storage parameter).
func (postgresDialect) Settings(ctx context.Context, conn gorm.ConnPool, t Tables) []Warning {
	var ws []Warning
	var on string
	if err := conn.QueryRowContext(ctx, `SHOW autovacuum`).Scan(&on); err != nil {
		ws = append(ws, Warning{Check: "postgres autovacuum", Err: err})
	} else if on != "on" {
		ws = append(ws, Warning{Message: "outbox: PostgreSQL runs with autovacuum off: the claim's plans rely on the outbox table's statistics, which then go stale, and the dead row versions that every lease and settle leave behind pile up; turn it on (autovacuum = on in postgresql.conf, or ALTER SYSTEM SET autovacuum = on and SELECT pg_reload_conf())", Attrs: []any{"autovacuum", on}})
	}
	rows, err := conn.QueryContext(ctx, postgresDialect{}.Bind(`SELECT c.relname, o.opt FROM pg_class c CROSS JOIN LATERAL unnest(c.reloptions) AS o(opt)
WHERE c.oid IN (to_regclass(?), to_regclass(?)) AND o.opt LIKE 'autovacuum\_enabled=%'`), t.Records, t.Sequences)
	if err != nil {
		ws = append(ws, Warning{Check: "postgres autovacuum_enabled", Err: err})
		return ws
	}
	defer rows.Close()
	var off []string
	for rows.Next() {
		var table, opt string
		if err := rows.Scan(&table, &opt); err != nil {
			ws = append(ws, Warning{Check: "postgres autovacuum_enabled", Err: err})
			return ws
		}
		if isFalse(strings.TrimPrefix(opt, "autovacuum_enabled=")) {
			off = append(off, table)
		}
	}
	if err := rows.Err(); err != nil {
		ws = append(ws, Warning{Check: "postgres autovacuum_enabled", Err: err})
		return ws
	}
	if len(off) > 0 {
		ws = append(ws, Warning{Message: "outbox: autovacuum is disabled on outbox tables (storage parameter autovacuum_enabled): the claim's plans rely on their statistics, which then go stale, and the dead row versions that every lease and settle leave behind pile up; ALTER TABLE ... RESET (autovacuum_enabled)", Attrs: []any{"tables", off}})
	}
	return ws
}

// CheckConn: nothing to check.
func (postgresDialect) CheckConn(context.Context, gorm.ConnPool) error { return nil }

// isFalse reports whether PostgreSQL reads the boolean storage parameter
// value v as false: off, no, false, 0, or a unique prefix of them.
func isFalse(v string) bool {
	v = strings.ToLower(strings.TrimSpace(v))
	switch {
	case v == "0" || v == "of" || v == "off":
		return true
	case v == "":
		return false
	}
	return strings.HasPrefix("false", v) || strings.HasPrefix("no", v)
}
